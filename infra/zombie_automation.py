"""Create (or update) the automation that marks zombie flow runs Crashed on the Prefect server at
$PREFECT_API_URL.

A flow run of a deployment emits a `prefect.flow-run.heartbeat` event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
seconds (`dapo deploy` sets 30 unless it is set; Prefect's default is 180). When the host dies — the serving
process and the flow-run process together — nothing reports a final state and the run would stay Running
forever. This automation is Prefect's "detect zombie flows" recipe: after a heartbeat, expect another
heartbeat or a final state within `--within` seconds (default 90 = three missed 30 s beats); if none comes,
set the flow run's state to Crashed. Retry it in the UI afterwards; it continues from the run store.

    PREFECT_API_URL=http://127.0.0.1:4200/api .venv/bin/python infra/zombie_automation.py [--within 90]

`infra/prefect_server.sh start` runs it. Choose `--within` at least twice the heartbeat frequency: a
heartbeat delayed by a busy machine must not crash a healthy run.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

NAME = "dapo: crash zombie flow runs"
"""The automation's name (one per server; running this script again updates it)."""


def zombie_automation(within_s: int):
    """The automation object (not yet created on the server)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=NAME,
        description=f"Marks a flow run Crashed when it sent no heartbeat and no final state for {within_s} s "
        "(the host or the flow-run process died). Created by infra/zombie_automation.py.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within_s} s: the flow-run process or its host died "
                "(infra/zombie_automation.py); press Retry to continue the run",
            )
        ],
    )


def ensure(within_s: int) -> str:
    """Create the automation, or replace it when one of the same name exists; returns its id."""
    from prefect.automations import Automation

    try:
        old = Automation.read(name=NAME)
    except ValueError:
        old = None
    if old is not None:
        old.delete()
    return str(zombie_automation(within_s).create().id)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--within", type=int, default=90, help="seconds without a heartbeat (default 90)")
    args = parser.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print("PREFECT_API_URL is not set: export PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
        return 2
    if args.within < 60:
        print("--within must be at least 60 s (two 30 s heartbeats)", file=sys.stderr)
        return 2
    print(f"automation {NAME!r} ({args.within} s without a heartbeat -> Crashed): {ensure(args.within)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every stage of every DVC lineage tracks parameters its params file has: DVC resolves each tracked key
(`ParamsDependency.get_hash`, what `dvc repro` does when it saves a stage), so no lineage stops at a missing
key after its command ran."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_tracked_parameter_resolves_in_every_lineage(monkeypatch):
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    monkeypatch.chdir(ROOT)
    with Repo(str(ROOT)) as repo:
        stages = [s for s in repo.index.stages if any(isinstance(d, ParamsDependency) for d in s.deps)]
        lineages = {str(Path(s.path_in_repo).parent) for s in stages}
        assert {".", "pipelines/smollm2", "pipelines/dapo_math"} <= lineages, lineages
        for stage in stages:
            for dep in stage.deps:
                if isinstance(dep, ParamsDependency):
                    tracked = dep.get_hash().value
                    assert tracked, (stage.addressing, dep.def_path)
                    for key in dep.params or []:
                        assert key in tracked, (stage.addressing, key)

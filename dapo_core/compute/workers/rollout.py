"""RolloutWorker: generates responses for prompt rows with a rollout engine (HF generate or vLLM).

Input rows are already one per sample (the driver repeats each prompt `n` times and stamps
`uid`/`sample_idx`); each row's sampling seed is `request_seed(seed, gen_step, uid, sample_idx)`, so
regenerating a committed step after a crash gives the same tokens where the engine is deterministic (HF on CPU
is). `generate_stage` reads its prompts from the run store and commits its output itself (`StageJob`);
`validation_stage` does the same for the held-out prompts (it repeats them `val_kwargs.n` times itself, so
only the distinct prompts are ever written by the driver). With several rollout replicas
(`dapo_core.compute.replicas`) each replica gets the same job with `rows`, the positions of its share of the
(repeated) rows, commits that share, and refuses to generate unless its weights are `expect_version`.
On CPU each generation ends by handing the heap's free pages back to the OS (`dapo_core.compute.heap`), so
the process's peak stays one pass's.
On a colocated GPU pool `release_memory` frees the engine's GPU memory for the training ranks (vLLM's sleep
mode; the HF engine returns its cached blocks) and the next generation or weight load takes it back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.faults import fault_point
from dapo_core.compute.heap import trim_heap
from dapo_core.data import batch as B
from dapo_core.errors import DapoUserError
from dapo_core.seeding import request_seed, uid_factory
from dapo_core.store.jobs import StageJob, run_job


def generation_metrics(out: pa.Table) -> dict[str, float]:
    """Mean response length and generated tokens of a generation batch."""
    lens = B.response_lengths(out)
    return {
        "response_length/gen_mean": float(sum(lens) / max(len(lens), 1)),
        "perf/gen_tokens": float(sum(lens)),
    }


class StaleWeights(DapoUserError):
    """A rollout replica was asked to generate with weights other than the version the driver pushed last."""


class RolloutWorker:
    """Holds one rollout engine. `train_sampling` / `val_sampling` are dicts of SamplingParams fields;
    `num_threads`, when given, sets this process's torch threads (one replica's share of the cores)."""

    def __init__(
        self,
        model_path: str,
        *,
        engine: str = "hf",
        device: str = "cpu",
        seed: int = 0,
        train_sampling: Mapping[str, Any],
        val_sampling: Mapping[str, Any],
        engine_opts: Mapping[str, Any] | None = None,
        num_threads: int | None = None,
        visible_devices: str | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        if visible_devices is not None:  # a colocated TP replica's GPUs, set before CUDA starts
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.device = device
        self._released = False
        self.seed = int(seed)
        self.engine = make_rollout_engine(
            engine, model_path, device=device, seed=seed, **dict(engine_opts or {})
        )
        self.train_params = SamplingParams(**dict(train_sampling))
        self.val_params = SamplingParams(**dict(val_sampling))

    def generate(
        self, table: pa.Table, gen_step: int, validate: bool = False, expect_version: int | None = None
    ) -> pa.Table:
        """Add `response_ids`, `rollout_log_probs`, `finish_reason`, `weight_version`, `gen_step` to
        `table`; with `expect_version`, raise `StaleWeights` unless the engine holds that weight version."""
        self.check_version(expect_version)
        self._take_memory()
        params = self.val_params if validate else self.train_params
        uids = table.column("uid").to_pylist()
        sample_idx = table.column("sample_idx").to_pylist()
        prompts = table.column("prompt_ids").to_pylist()
        seed = self.seed + (1_000_003 if validate else 0)
        seeds = [request_seed(seed, gen_step, u, s) for u, s in zip(uids, sample_idx, strict=True)]
        outs = self.engine.generate(prompts, params, seeds)
        if self.device == "cpu":  # the pass's freed buffers back to the OS, not kept per call thread
            trim_heap()
        n = table.num_rows
        cols = {
            "response_ids": pa.array([list(o.token_ids) for o in outs], type=pa.list_(pa.int32())),
            "rollout_log_probs": pa.array(
                [[float(x) for x in o.log_probs] for o in outs], type=pa.list_(pa.float32())
            ),
            "finish_reason": pa.array([o.finish_reason for o in outs], type=pa.string()),
            "weight_version": pa.array([self.engine.weight_version] * n, type=pa.int64()),
            "gen_step": pa.array([int(gen_step)] * n, type=pa.int64()),
        }
        for name, col in cols.items():
            table = B.set_column(table, name, col)
        return table

    def generate_stage(
        self,
        job: StageJob,
        gen_step: int,
        rows: list[int] | None = None,
        expect_version: int | None = None,
    ) -> tuple[str, dict[str, float]]:
        """`generate` on the prompts at `job.input_uri` (only the rows at positions `rows`, in that order,
        when given), committed by this worker as `job.stage`; returns its URI and the generation metrics."""
        fault_point(job.root, job.stage, job.step)
        self.check_version(expect_version)

        def compute(table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
            out = self.generate(_take(table, rows), gen_step, False, expect_version)
            return out, generation_metrics(out)

        return run_job(job, compute)

    def validation_stage(
        self,
        job: StageJob,
        gen_step: int,
        *,
        n: int,
        uid_seed: int,
        rows: list[int] | None = None,
        expect_version: int | None = None,
    ) -> tuple[str, dict[str, float]]:
        """The validation generation: the distinct held-out prompts at `job.input_uri`, each repeated `n`
        times with uids seeded by (`uid_seed`, "val", `job.step`) (only the repeated rows at positions `rows`
        when given), generated with the validation sampling settings and committed by this worker as
        `job.stage` (no metrics: validation's are the scorer's)."""
        self.check_version(expect_version)

        def compute(prompts: pa.Table) -> tuple[pa.Table, dict[str, float]]:
            uid_fn = uid_factory(uid_seed, "val", job.step)
            table = _take(B.repeat_interleave_prompts(prompts, n, uid_fn=uid_fn), rows)
            return self.generate(table, gen_step, True, expect_version), {}

        return run_job(job, compute)

    def weight_version(self) -> int:
        """The version of the weights the engine holds (what it stamps on the rows it generates)."""
        return int(self.engine.weight_version)

    def check_version(self, expect: int | None) -> None:
        """Raise `StaleWeights` when the engine holds no weights (version -1: started on unset weights, or
        released at sleep level 2, and not pushed to since), or when `expect` is given and the engine holds
        another weight version."""
        if self.engine.weight_version < 0:
            raise StaleWeights(
                "this rollout replica holds no weights (it started on unset weights or discarded them while "
                "the training ranks ran) and has not received a push since, so it generates nothing",
                fix="push the actor's weights first (RolloutReplicas.push_from), or resume the run",
            )
        if expect is not None and int(expect) != self.engine.weight_version:
            raise StaleWeights(
                f"this rollout replica holds weight version {self.engine.weight_version}, but the driver "
                f"expects version {expect}: it missed the last weight update, so it generates nothing",
                fix="resume the run (new rollout replicas load the checkpoint's weights)",
            )

    def sync_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Load new weights (HF names) into the engine, as they come (an in-process push streams them);
        returns the new weight version."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        with self._loading():
            self.engine.sync_weights(items)
        return self.engine.weight_version

    def weight_endpoint(self) -> dict[str, Any]:
        """Where a push's control group can meet on this worker's node (its address and a free port), and
        the device and dtype this worker's engine takes weights in."""
        from dapo_core.compute.dist import free_port, node_address

        return {
            "host": node_address(),
            "port": free_port(),
            "device": "cuda" if self.device == "cuda" else "cpu",
            "dtype": self.engine.weight_dtype,
        }

    def receive_weights(self, link: Mapping[str, Any], index: int) -> dict[str, float]:
        """Receive one push over `link` (`dapo_core.compute.weight_transport`; this worker is receiver
        `index` of it), loading each tensor as it completes; the push must cover every weight of the engine.
        Bumps the weight version; returns the push's `weight_sync/*` figures on this end."""
        from dapo_core.compute.weight_transport import Link, receive_into

        spec = Link(**dict(link))
        with self._loading():
            stats = receive_into(
                spec,
                index,
                lambda named: self.engine.load_tensors(named, spec.bucket_bytes),
                expect=self.engine.weight_names(),
            )
        self.engine.weight_version += 1
        return stats.as_metrics()

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """Around a weight load: a released (sleeping) engine wakes its weights first and its cache only
        after the load, so the cache takes its room once the new weights are in (vLLM level 2 then pushes
        into freshly allocated weights)."""
        if not self._released:
            yield
            return
        engine: Any = self.engine
        engine.wake_up(tags=["weights"])
        yield
        engine.wake_up(tags=["kv_cache"])
        self._released = False

    def set_weight_version(self, version: int) -> int:
        """Stamp the engine's weight version (after a resume the loaded weights carry the checkpoint's
        version); returns it."""
        self.engine.weight_version = int(version)
        return self.engine.weight_version

    def release_memory(self) -> None:
        """Free the engine's GPU memory while the training ranks on the same GPUs run: vLLM's sleep mode at
        level 2 (weights and KV cache dropped, nothing kept in host RAM; the next push loads the weights,
        as verl does; needs `enable_sleep_mode`), else the CUDA caching allocator's free blocks. No-op on
        CPU. The discarded weights hold no version (-1), so a generation before the next push is refused
        as stale (`check_version`) instead of sampling from them."""
        engine: Any = self.engine  # sleep mode: the vLLM engine's
        if getattr(engine, "enable_sleep_mode", False):
            if not self._released:
                engine.sleep(level=2)
                engine.weight_version = -1
                self._released = True
        elif self.device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _take_memory(self) -> None:
        """Take back what `release_memory` freed (vLLM: wake up) before generating or loading weights."""
        if self._released:
            engine: Any = self.engine
            engine.wake_up()
            self._released = False

    def close(self) -> None:
        """Release the engine."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def _take(table: pa.Table, rows: list[int] | None) -> pa.Table:
    """The rows of `table` at positions `rows` (all of it when None)."""
    return table if rows is None else table.take(pa.array(rows, type=pa.int64()))

"""The actor's end of a weight push, run in a spawned process by the vLLM-CPU transport test.

`push_perturbed` loads the tiny model, adds noise, saves the result as an HF folder (the HF reference
reads it) and streams the same weights over a link with `weight_transport.send_all`, as an actor rank
does; the sender's `PushStats` go back through a queue. Nothing here imports vllm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def push_perturbed(model_path: str, out_dir: str, link: Any, std: float, seed: int, results: Any) -> None:
    """Perturb the model at `model_path` by N(0, std²) noise, save it to `out_dir`, push it over `link`
    (source rank 0) and put the sender's `PushStats` fields (or the error) on `results`."""
    try:
        import torch

        from dapo_core.compute.models import load_model, load_tokenizer, save_model
        from dapo_core.compute.weight_transport import distinct_tensors, send_all
        from tests.vllm_cpu.conftest import perturbed_state

        torch.set_num_threads(1)
        model = load_model(Path(model_path))
        with torch.no_grad():
            for name, tensor in perturbed_state(model, std, seed).items():
                model.get_parameter(name).copy_(tensor)
        save_model(model, load_tokenizer(Path(model_path)), Path(out_dir))
        # keep_vars: the parameters themselves, so a tied LM head is announced as an alias, not sent
        stats = send_all(distinct_tensors(model.state_dict(keep_vars=True).items()), [link], rank=0)
        results.put({"ok": True, **{k: v for k, v in vars(stats).items() if k != "extra"}})
    except BaseException as e:  # the test process reports it
        results.put({"ok": False, "error": repr(e)})
        raise

#!/usr/bin/env bash
# GPU memory check: the passes of a 1-GPU, dp=1 run of a randomly initialised model of
# Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, i 4864, vocab 151,936), each measured on cuda
# (torch.cuda.max_memory_allocated above the loaded weights) next to `dapo plan`'s estimate of the same bytes:
#   - actor update, torch engine: checkpointing + packed + token budget, and packed + budget without checkpointing;
#   - actor update, fsdp2 engine at dp=1 (when the engine is present: actor.strategy fsdp2);
#   - rollout: one HF-engine generation of 64 rows (8 prompts × n 8) of 1,024 + 1,024 tokens.
# It prints each plan, a table of plan / measured / ratio, and writes $OUT/gpu_memory_check.json. Budget: under
# 8 minutes on one H200 (model build ~1 min, each actor config ~1-2 min, the generation ~1 min).
#
#   run(command="bash bench/gpu_memory_check.sh", carry=["build/gpu_py"], timeout_s=540)
#
# The GPU machine's Python has torch, transformers, pyarrow and PyYAML but not omegaconf (which the config
# loader needs): copy the pure-Python packages there first, once, on the development machine:
#   mkdir -p build/gpu_py && cp -r .venv/lib/python3.11/site-packages/{omegaconf,antlr4} build/gpu_py/
# Env: OUT (output folder; a temp dir when unset), PYTHON (default python3), DEVICE (cuda; cpu for a dry run),
# SHAPE (qwen0.5b | small: the dry run's tiny shape), STEPS (actor updates per config, default 3).
# CPU dry run here: OUT=/tmp/gmc DEVICE=cpu SHAPE=small PYTHON=.venv/bin/python bash bench/gpu_memory_check.sh
set -uo pipefail

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHON="${PYTHON:-python3}" DEVICE="${DEVICE:-cuda}" SHAPE="${SHAPE:-qwen0.5b}" STEPS="${STEPS:-3}"
export PYTHONPATH=".:build/gpu_py${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT
LOG="$OUT/gpu_memory_check.log"

{
echo "=== dapo gpu_memory_check $(date -u +%Y-%m-%dT%H:%M:%SZ) device=$DEVICE shape=$SHAPE steps=$STEPS"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total --format=csv
"$PYTHON" - <<'EOF'
import json, os, tempfile, time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_core.compute.models import build_char_tokenizer, save_model
from dapo_core.compute.engines.train import TRAIN_ENGINES
from dapo_core.compute.plan import BUILTIN_SHAPES, run_plan
from tests.helpers import measure_actor_update, measure_rollout
from dapo_core.config import load_config, typed

device, shape_name, steps, out = os.environ["DEVICE"], os.environ["SHAPE"], int(os.environ["STEPS"]), os.environ["OUT"]
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), flush=True)
if device == "cuda":
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name} {p.total_memory / 2**30:.1f} GiB", flush=True)
else:
    torch.set_num_threads(1)

s = BUILTIN_SHAPES["Qwen2.5-0.5B"]
if shape_name == "small":  # the CPU dry run: same code path, a model a CPU trains in seconds
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                intermediate_size=128, vocab_size=1000)
    lengths, rows, budget = (32, 96), 4, 256
    gen_lengths = (32, 64)
else:
    dims = dict(hidden_size=s.hidden_size, num_hidden_layers=s.num_hidden_layers,
                num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
                head_dim=s.head_dim, intermediate_size=s.intermediate_size, vocab_size=s.vocab_size)
    lengths, rows, budget = (1024, 7168), 16, 16384  # 16 rows x 8,192 tokens, 16,384-token micro-batches
    gen_lengths = (1024, 1024)
t0 = time.time()
folder = tempfile.mkdtemp(prefix="q05_")
config = Qwen2Config(**dims, max_position_embeddings=sum(lengths), tie_word_embeddings=True, rope_theta=1e6,
                     torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
save_model(Qwen2ForCausalLM(config), build_char_tokenizer(), folder)
print(f"random-init model ({sum(lengths)} positions) written to {folder} in {time.time() - t0:.0f} s", flush=True)

base = [
    f"actor_rollout_ref.model.path={folder}",
    f"data.max_prompt_length={lengths[0]}", f"data.max_response_length={lengths[1]}",
    "actor_rollout_ref.rollout.n=1", f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
    "actor_rollout_ref.actor.strategy=torch", f"trainer.device={device}", "actor_rollout_ref.model.sft.enable=false",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
]
features = {
    "ckpt+packed+budget": ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
                           "actor_rollout_ref.model.use_remove_padding=true",
                           "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"],
    "packed+budget (no ckpt)": ["actor_rollout_ref.model.use_remove_padding=true",
                                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"],
}
if "fsdp2" in TRAIN_ENGINES:  # the sharded engine at dp=1 (one rank: shards are the whole model)
    features["fsdp2 dp=1 ckpt+packed+budget"] = features["ckpt+packed+budget"] + [
        "actor_rollout_ref.actor.strategy=fsdp2", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]
rollout = [f"data.max_prompt_length={gen_lengths[0]}", f"data.max_response_length={gen_lengths[1]}",
           "data.train_batch_size=8", "data.gen_batch_size=8", "actor_rollout_ref.rollout.n=8",
           "actor_rollout_ref.rollout.max_num_seqs=64", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
features["rollout generate (hf, 64 rows)"] = rollout
results = []
for name, feats in features.items():
    cfg = typed(load_config("configs/tiny_cpu.yaml", base + feats))
    print(f"\n=== {name}: dapo plan", flush=True)
    run_plan(cfg, "plan", gpu_mem="141GiB" if device == "cuda" else None)
    t0 = time.time()
    try:
        if name.startswith("rollout"):
            r = measure_rollout(cfg, folder, device=device)
            r.pop("rows")
        else:
            r = measure_actor_update(cfg, folder, device=device, steps=steps)
    except Exception as e:  # out of memory or a failing pass is a finding, not a crash of the check
        if not isinstance(e, torch.OutOfMemoryError):
            print(f"=== {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append({"config": name, "error": str(e)[:300]})
            continue
        print(f"=== {name}: out of memory: {str(e)[:300]}", flush=True)
        results.append({"config": name, "oom": True})
        torch.cuda.empty_cache()
        continue
    r = {"config": name, **r, "ratio": r["measured"] / r["estimated"], "seconds": time.time() - t0}
    results.append(r)
    print(f"=== {name}: measured peak above weights {r['measured'] / 2**30:.2f} GiB, plan {r['estimated'] / 2**30:.2f} "
          f"GiB (measured/plan {r['ratio']:.2f}); weights {r['weights'] / 2**30:.2f} GiB; {steps} steps in "
          f"{r['seconds']:.0f} s", flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
json.dump(results, open(os.path.join(out, "gpu_memory_check.json"), "w"), indent=1)
print("\n| config | plan GiB | measured GiB | measured / plan |\n|---|---|---|---|")
for r in results:
    if r.get("oom") or r.get("error"):
        print(f"| {r['config']} | | {'OOM' if r.get('oom') else 'failed'} | |")
    else:
        print(f"| {r['config']} | {r['estimated'] / 2**30:.2f} | {r['measured'] / 2**30:.2f} | {r['ratio']:.2f} |")
EOF
rc=$?
echo "=== exit $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)"
exit $rc
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

"""The `transformers` `generate` baseline for `vtllm bench`, on the same model shape
(random bf16 weights), the same random prompts and the same device, in the same run.

    python3 benchmarks/hf_baseline.py --model-shape qwen3-0.6b latency
    python3 benchmarks/hf_baseline.py --model-shape qwen3-0.6b throughput --num-prompts 64

Latency: batch 1, `--input-len` prompt tokens, `--output-len` greedy tokens; decode tok/s
excludes the prefill (a 1-token generate is timed separately and subtracted).
Throughput: the first `--num-prompts` prompts of `vtllm bench throughput` (same seed and
length ranges), left-padded into one static batch generating the longest requested output;
only the requested output tokens count. Prints one JSON object per kind.

Mixtures of experts (`--model-shape qwen3-30b-a3b`): transformers runs the experts as its
own grouped/batched matmuls; a 256-prompt static batch of up to 2048 tokens is too slow and
too large for one benchmark call, so `benchmarks/h200_run.sh` gives it the first 32 prompts
(`num_prompts` in the output says how many; compare tok/s, not wall time).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vtllm.bench import MODEL_SHAPES, shape_config, throughput_requests  # noqa: E402


def build_model(shape: str):
    config_dict = dict(shape_config(shape))
    model_type = config_dict.pop("model_type")
    config_dict.pop("architectures")
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def timed_generate(model, input_ids, attention_mask, new_tokens: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - started


def latency(model, args, vocab: int) -> dict:
    rng = random.Random(0)
    ids = torch.tensor(
        [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)]], device="cuda"
    )
    mask = torch.ones_like(ids)
    timed_generate(model, ids, mask, 8)  # warm-up
    prefill = min(timed_generate(model, ids, mask, 1) for _ in range(3))
    full = min(timed_generate(model, ids, mask, args.output_len) for _ in range(2))
    return {"kind": "latency", "decode_tok_s": round((args.output_len - 1) / (full - prefill), 1)}


def throughput(model, args, vocab: int) -> dict:
    # the timed requests of vtllm bench throughput: the same draws, in the same order
    requests = [(p, o) for _, p, o in throughput_requests(args, vocab, args.num_prompts, 0, "hf")]
    width = max(len(p) for p, _ in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(requests):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    longest = max(o for _, o in requests)
    wall = timed_generate(model, ids, mask, longest)
    useful = sum(o for _, o in requests)
    return {
        "kind": "throughput",
        "num_prompts": len(requests),
        "wall_s": round(wall, 2),
        "output_tok_s": round(useful / wall, 1),
        "total_tok_s": round((useful + sum(len(p) for p, _ in requests)) / wall, 1),
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model-shape", required=True, help=f"{', '.join(MODEL_SHAPES)} or a config.json path"
    )
    parser.add_argument("kind", choices=("latency", "throughput", "all"))
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024))
    args = parser.parse_args()
    model = build_model(args.model_shape)
    vocab = shape_config(args.model_shape)["vocab_size"]
    kinds = ("latency", "throughput") if args.kind == "all" else (args.kind,)
    for kind in kinds:
        result = (latency if kind == "latency" else throughput)(model, args, vocab)
        result.update(
            model=args.model_shape,
            baseline="transformers.generate",
            transformers=transformers.__version__,
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

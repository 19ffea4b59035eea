"""vLLM command lines on vtllm: which vLLM flags vtllm takes, under which name, and why
the others are refused.

``VLLM_ALIASES`` are extra spellings of vtllm flags (argparse aliases); the vLLM flags
with the same name as a vtllm flag need no entry. ``UNSUPPORTED`` names vLLM flags vtllm
refuses, each with the reason that the error message (and docs/USAGE.md) gives.
"""

from __future__ import annotations

import difflib

# vtllm flag → the further spellings vLLM users type
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--no-enable-log-requests": ("--disable-log-requests", "--disable-uvicorn-access-log"),
}

# vLLM flag → why vtllm refuses it (one clause, shown after "vtllm does not support it: ")
UNSUPPORTED: dict[str, str] = {
    "--pipeline-parallel-size": "one host only; use --tensor-parallel-size",
    "--data-parallel-size": "run one vtllm per replica behind a load balancer",
    "--swap-space": "preempted requests are recomputed, never swapped to host memory",
    "--cpu-offload-gb": "weights stay on the device",
    "--enable-lora": "no LoRA adapters",
    "--speculative-config": "no speculative decoding",
    "--disable-custom-all-reduce": "vtllm has no custom all-reduce (torch.distributed only)",
    "--tokenizer-mode": "vtllm always uses the fast tokenizer (tokenizer.json)",
    "--max-seq-len-to-capture": "decode graphs cover max_model_len (see --enforce-eager)",
    "--distributed-executor-backend": "workers are always local processes",
    "--limit-mm-per-prompt": "text-only models",
    "--calculate-kv-scales": (
        "FP8 KV-cache scales come from the checkpoint or are 1.0, never from traffic "
        "(see --kv-cache-dtype)"
    ),
}


def unsupported_message(flag: str) -> str | None:
    """The one-line refusal for a vLLM flag vtllm does not take, else None."""
    name = flag.split("=", 1)[0]
    reason = UNSUPPORTED.get(name)
    if reason is None:
        return None
    return f"{name} is a vLLM flag vtllm does not support: {reason}"


def closest_flag(flag: str, known: list[str]) -> str | None:
    """The known flag nearest to ``flag`` by spelling (``--max-model-lenght`` →
    ``--max-model-len``), or None when nothing is close."""
    name = flag.split("=", 1)[0]
    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return matches[0] if matches else None

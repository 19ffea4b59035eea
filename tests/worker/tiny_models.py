"""Tiny random-weight HF models saved as safetensors, and an engine stand-in that drives a
ModelRunner with ``SchedulerOutput`` deltas exactly as the engine core sends them.

transformers is the reference here only; vtllm code never imports it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vtllm.protocol.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

VOCAB_SIZE = 512
# small enough that the test sequences (up to ~30 tokens) slide past it
SLIDING_WINDOW = 6
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=[2, 3],
)


def hf_config(kind: str):
    """A transformers config for ``llama`` (untied, llama3 rope scaling), ``llama_tied``,
    ``mistral`` (sliding window on every layer), ``qwen2`` (qkv bias, sliding window from
    layer 1 on), ``qwen3`` (q/k norm, explicit head_dim) or ``gemma3`` (local/global
    layers with their own rope, GeGLU, (1 + w) norms, query_pre_attn_scalar, logit
    soft-capping), ``qwen3_moe`` or ``mixtral`` (mixtures of experts)."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(
            **_COMMON,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if kind == "llama_tied":
        return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(
            **_COMMON, sliding_window=SLIDING_WINDOW, rope_theta=1e6, tie_word_embeddings=False
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            **_COMMON,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=1,
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            head_dim=32,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=3,  # local, local, global
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            query_pre_attn_scalar=24,
            final_logit_softcapping=0.5,
            tie_word_embeddings=True,
        )
    if kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers), top-2 of 8 not renormalised
        return transformers.Qwen3MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    if kind == "mixtral":  # top-2 of 4 experts, sliding window on every layer
        return transformers.MixtralConfig(
            **{**_COMMON, "intermediate_size": 40},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            tie_word_embeddings=False,
        )
    if kind.startswith("gemma4"):
        return _gemma4_config(kind)
    raise ValueError(kind)


def _gemma4_config(kind: str):
    """Gemma 4 text configs shaped like the released checkpoints, shrunk:

    * ``gemma4_moe`` (26B-A4B): dense MLP beside 8 experts (top 2), full layers with
      ``attention_k_eq_v``, their own head_dim and KV heads, proportional rope
      (``gemma4_moe_tp2``: 2 KV heads on full layers too, for tensor parallelism);
    * ``gemma4_dense`` (31B): the same attention, no experts;
    * ``gemma4_ple`` (E2B/E4B): per-layer inputs, the last 2 of 5 layers share KV (and have
      a double-wide MLP), separate k and v projections on full layers;
    * ``gemma4_wrapper``: ``gemma4_moe``'s text inside ``Gemma4ForConditionalGeneration``
      with a vision tower (the form Google releases).
    """
    import transformers

    sliding, full = "sliding_attention", "full_attention"
    text = dict(
        **{**_COMMON, "num_hidden_layers": 4},
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=SLIDING_WINDOW,
        layer_types=[sliding, full, sliding, full],
        rope_parameters={
            sliding: {"rope_type": "default", "rope_theta": 100.0},
            full: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e4},
        },
        final_logit_softcapping=0.5,
        hidden_size_per_layer_input=0,
        tie_word_embeddings=True,
    )
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)
    if kind == "gemma4_moe":
        return transformers.Gemma4TextConfig(**text, **moe)
    if kind == "gemma4_moe_tp2":  # full layers' KV heads divisible by 2, as in the 26B
        return transformers.Gemma4TextConfig(**{**text, "num_global_key_value_heads": 2}, **moe)
    if kind == "gemma4_dense":
        return transformers.Gemma4TextConfig(**text)
    if kind == "gemma4_ple":
        return transformers.Gemma4TextConfig(
            **{
                **text,
                "num_hidden_layers": 5,
                "layer_types": [sliding, full, sliding, sliding, full],
                "attention_k_eq_v": False,
                "num_global_key_value_heads": None,
                "hidden_size_per_layer_input": 8,
            },
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            vocab_size_per_layer_input=VOCAB_SIZE,
        )
    if kind == "gemma4_wrapper":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
        )
        return transformers.Gemma4Config(
            text_config={**text, **moe}, vision_config=vision, audio_config=None
        )
    raise ValueError(kind)


def make_hf_model(kind: str, out_dir: Path, seed: int = 0, **overrides):
    """Random fp32 model saved to ``out_dir``; returns the transformers model (eval).
    ``overrides`` replace attributes of ``hf_config(kind)`` (e.g. ``moe_intermediate_size``)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    if isinstance(config, transformers.Gemma4Config):  # a multimodal wrapper
        model = transformers.Gemma4ForConditionalGeneration._from_config(
            config, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # give norms, scales and biases non-trivial values
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "scale")):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: a learned scale kept as a buffer
                buffer.mul_(1 + torch.randn_like(buffer) * 0.1)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@torch.no_grad()
def hf_last_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[vocab]`` log-softmax of the reference model's last-position logits."""
    logits = model(torch.tensor([token_ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@dataclass
class SimRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False
    num_tokens_sent: int = 0  # tokens the worker knows about


class EngineSim:
    """Allocates blocks in random order and sends steps like the engine core."""

    def __init__(self, execute, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.execute = execute
        self.block_size = block_size
        self.free_blocks = list(range(1, num_blocks))  # block 0 reserved, as in the engine
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, SimRequest] = {}
        self.step_id = 0
        self.finished: list[str] = []

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = SimRequest(list(prompt), len(prompt), params)

    def finish(self, request_id: str) -> None:
        self.free_blocks.extend(self.requests.pop(request_id).block_ids)
        self.finished.append(request_id)

    def step(self, schedule: dict[str, int]) -> ModelRunnerOutput:
        """Compute ``schedule[id]`` tokens of each request; append sampled tokens."""
        new, cached = [], []
        for request_id, num_tokens in schedule.items():
            req = self.requests[request_id]
            end = req.num_computed_tokens + num_tokens
            assert end <= len(req.token_ids)
            needed = -(-end // self.block_size) - len(req.block_ids)
            new_blocks = [self.free_blocks.pop() for _ in range(max(0, needed))]
            req.block_ids.extend(new_blocks)
            if not req.sent:
                new.append(
                    NewRequestData(
                        request_id,
                        list(req.token_ids),
                        req.num_prompt_tokens,
                        req.params,
                        list(req.block_ids),
                        req.num_computed_tokens,
                    )
                )
                req.sent = True
            else:
                cached.append(
                    CachedRequestData(
                        request_id,
                        req.token_ids[req.num_tokens_sent :],
                        new_blocks,
                        req.num_computed_tokens,
                    )
                )
            req.num_tokens_sent = len(req.token_ids)
        step = SchedulerOutput(
            step_id=self.step_id,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=dict(schedule),
            finished_request_ids=self.finished,
        )
        self.finished = []
        self.step_id += 1
        output = self.execute(step)
        for request_id, num_tokens in schedule.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        for request_id, token_id in zip(output.request_ids, output.sampled_token_ids, strict=True):
            self.requests[request_id].token_ids.append(token_id)
        return output


def full_logprobs(output: ModelRunnerOutput, index: int, vocab_size: int) -> torch.Tensor:
    """``[vocab]`` logprobs of row ``index`` from a full-vocab ``top_logprobs`` answer."""
    values = torch.full((vocab_size,), float("nan"))
    for token_id, logprob in output.top_logprobs[index]:
        values[token_id] = logprob
    return values


README_QUESTION = "What is the capital of France?"


def readme_prompt(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the README's question in SmolLM2's chat format (``system``: a system
    turn before it)."""
    turns = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    turns += f"<|im_start|>user\n{README_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(turns).ids


def greedy_tokens(runner, prompt: list[int], num_tokens: int, block_size: int = 16) -> list[int]:
    """``num_tokens`` greedy tokens after ``prompt`` through ``runner.execute``: the
    prompt in one step, then one decode step a token (16 blocks of ``block_size``)."""
    engine = EngineSim(runner.execute, num_blocks=16, block_size=block_size)
    engine.add("greedy", prompt, SamplingParams(temperature=0.0))
    engine.step({"greedy": len(prompt)})
    for _ in range(num_tokens - 1):
        engine.step({"greedy": 1})
    return engine.requests["greedy"].token_ids[len(prompt) :]

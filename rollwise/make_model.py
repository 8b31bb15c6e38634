"""Create a random-initialised Llama/Qwen2/Qwen3/Qwen3-MoE model directory with a tokenizer trained here.

Nothing is downloaded: the byte-level BPE is trained with `tokenizers` on text that ships with the
package plus deterministic synthetic text (numbers, tool calls, SQL), and the weights are random.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# markup the model writes and the text keeps (as in Qwen): single tokens, but not "special"
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# ChatML as Qwen uses it, with tools rendered into the system message (Hermes format).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each call, return <tool_call>{\"name\": <name>, \"arguments\": <args-json>}</tool_call>"
    "<|im_end|>{{ '\\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}{% continue %}{% endif %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    # a call starts a line of its own after text or another call; arguments the client sends as a
    # JSON string (OpenAI's form) go in as they are, an object as JSON, so a reply the model wrote
    # renders back to the very text it generated
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set args = tc.function.arguments if tc.function is defined else tc.arguments %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name if tc.function is defined else tc.name }}\", \"arguments\": "
    "{{ args if args is string else args | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def training_text(seed: int = 0) -> list[str]:
    text = resources.files("rollwise").joinpath("data/corpus.txt").read_text()
    rng = random.Random(seed)
    lines = text.splitlines()
    names = ["calculator", "evaluate", "sql_query", "move", "search", "get_user", "book_flight"]
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        lines.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        name = rng.choice(names)
        args = {"expression": f"{a} {op} {b}"} if name != "move" else {"direction": rng.choice(["left", "up"])}
        lines.append(f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>')
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0, special_tokens: tuple[str, ...] = ()):
    """`special_tokens`: more special tokens, after the tags (e.g. Kimi-K2's tool-call markup)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS) - len(special_tokens),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def hf_config(family: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
              intermediate: int, head_dim: int, max_positions: int, tie: bool, eos_id: int, bos_id: int,
              experts: int = 8, experts_per_token: int = 2, moe_intermediate: int | None = None) -> dict:
    cfg = {
        "model_type": family, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": max_positions, "tie_word_embeddings": tie, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
    }
    if family == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False}
    elif family == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    else:
        cfg |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    if family == "qwen3_moe":
        if not 1 <= experts_per_token <= experts:
            raise ValueError(f"experts_per_token must be in 1..experts ({experts}), got {experts_per_token}")
        cfg |= {"num_experts": experts, "num_experts_per_tok": experts_per_token, "norm_topk_prob": True,
                "moe_intermediate_size": moe_intermediate or hidden // 2, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}
    return cfg


def make_model(out_dir: str | Path, *, family: str = "llama", layers: int = 2, hidden: int = 128,
               heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, vocab: int = 2048,
               head_dim: int | None = None, max_positions: int = 4096, tie: bool = False, seed: int = 0,
               std: float = 0.02, dtype: str = "float32", experts: int = 8, experts_per_token: int = 2,
               moe_intermediate: int | None = None, special_tokens: tuple[str, ...] = ()) -> Path:
    """`special_tokens`: the tokenizer's special tokens besides its own (a tool-call format's markup)."""
    from rollwise.engine.models.llama import FAMILIES, CausalLM, ModelConfig
    from rollwise.engine.models.loader import save_model

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, seed, tuple(special_tokens))
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"vocab ({vocab}) is smaller than the tokenizer's {tok.get_vocab_size()} tokens")
    eos_id, bos_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = hf_config(family, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    intermediate=intermediate or _ffn(hidden), head_dim=head_dim or hidden // heads,
                    max_positions=max_positions, tie=tie, eos_id=eos_id, bos_id=bos_id, experts=experts,
                    experts_per_token=experts_per_token, moe_intermediate=moe_intermediate)
    model = CausalLM(ModelConfig.from_hf(cfg), max_positions=8)
    model.init_weights(seed, std)
    save_model(model, cfg, out, dtype=None if dtype == "float32" else dtype)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions, "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id]}, indent=2) + "\n")
    return out


def make_reward_model(policy_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A reward model on a policy checkpoint's weights, config and tokenizer (its family's
    `*ForSequenceClassification`, one label, a random `score` head), as reward models start from
    a policy's checkpoint before they are trained; `reward = "model"` reads it."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification
    out = Path(out_dir)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1).save_pretrained(out)
    for f in Path(policy_dir).iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


def cached_model(out_dir: str | Path, **make_kwargs) -> Path:
    """`out_dir`, made with make_model(**make_kwargs) unless it is there. It is built beside its place
    and renamed into it, so processes that share a cache (tests in parallel, two benchmarks) never read
    a half-written model; when two build it at once, the first rename wins and the other's is dropped."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        make_model(tmp, **make_kwargs)
        if out.is_dir() and not (out / "config.json").exists() and not any(out.iterdir()):
            out.rmdir()  # an empty directory where the model goes
        try:
            os.rename(tmp, out)
        except OSError as e:
            if not (out / "config.json").exists():  # something else is there: leave it to the user
                raise FileExistsError(f"{out} is there without a config.json (a build that was cut off?): "
                                      f"remove it and the model is built there") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _ffn(hidden: int) -> int:
    return (int(hidden * 8 / 3) + 63) // 64 * 64

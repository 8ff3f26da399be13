"""A deterministic tiny hybrid SWA model (Mellum type) for the CPU engine (tests and the gate only).

``make_model(out)`` writes a Hugging Face folder SGLang 0.5.23 serves on CPU with its hybrid SWA
KV pool and SWA-aware radix cache: sliding-window and full attention layers alternate, the MLPs mix
dense and MoE, the weights are random from a fixed seed, and the tokenizer is a byte-level BPE
trained here on a corpus generated from the same seed (nothing is downloaded). The window is small
(32 by default) so prompts of a few thousand tokens exercise SWA eviction.

Same arguments, same bytes: the folder carries a stamp of its spec, and a folder whose stamp
matches is reused as is (one build per machine, about 2 s).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP = "dsv41_model_spec.json"
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = ["def", "return", "import", "class", "self", "if", "else", "for", "while", "in", "not", "and", "or", "None", "True", "False", "print", "value", "index", "cache", "token", "window", "prefix", "session", "request", "batch", "chunk", "decode", "prefill", "layer", "head", "tensor", "page", "slot", "evict", "resume", "agent", "tool", "call", "result", "error", "list", "dict", "int", "str", "float", "len", "range", "open", "read"]


@dataclass(frozen=True)
class ModelSpec:
    window: int = 32  # sliding window of the SWA layers (tokens)
    seed: int = 0
    layers: int = 4  # alternating sliding_attention / full_attention
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 1024
    experts: int = 4
    max_positions: int = 16384
    dtype: str = "float32"  # fp32: greedy tokens do not flip between batch shapes as easily as in bf16

    def validate(self) -> None:
        checks = {
            "window": (self.window >= 1, "an integer >= 1"),
            "layers": (self.layers >= 2 and self.layers % 2 == 0, "an even integer >= 2 (SWA and full alternate)"),
            "heads": (self.heads >= 1 and self.heads % max(self.kv_heads, 1) == 0, "a multiple of kv_heads"),
            "vocab": (self.vocab >= 300, "an integer >= 300 (bytes plus specials plus merges)"),
            "dtype": (self.dtype in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
            "max_positions": (self.max_positions > self.window, "greater than window"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"ModelSpec.{name}={getattr(self, name)!r} is invalid: expected {allowed}")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Python-like lines from a seeded generator: the tokenizer's training text and prompt material."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        out.append(f"{' ' * 4 * rng.randint(0, 2)}{' '.join(words)}({rng.randint(0, 999)}) # {i}")
    return out


def _tokenizer(spec: ModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(spec.seed), trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def make_model(out: str | Path, spec: ModelSpec | None = None) -> Path:
    """Write (or reuse) the model folder ``out`` for ``spec``; returns its path."""
    spec = spec or ModelSpec()
    spec.validate()
    out = Path(out)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("digest") == spec.digest():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(spec)
    tokenizer.save_pretrained(out)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|bos|>", "<|eos|>", "<|pad|>")}
    config = AutoConfig.for_model(
        "mellum",
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, sliding_window=spec.window,
        layer_types=["sliding_attention", "full_attention"] * (spec.layers // 2),
        mlp_layer_types=["dense"] + ["sparse"] * (spec.layers - 1),
        moe_intermediate_size=spec.hidden // 2, num_experts_per_tok=2, num_local_experts=spec.experts,
        bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"], pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["MellumForCausalLM"]
    dtype = getattr(torch, spec.dtype)
    generator = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):  # sorted: the draw order is the name order
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=1))
    return out

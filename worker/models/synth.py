"""Deterministic random-weight GGUF models of the real ``llama`` architecture.

(``tiny-swa`` is a ``cohere2`` model, ``tiny-ssm`` a ``mamba`` one and ``tiny-hybrid`` a
``jamba`` one, Mamba layers alternating with attention layers, instead: a sliding-window
cache, a recurrent state and a hybrid memory are the kinds kvpool cannot cut into chunks
and shares through whole-state checkpoints, so tests can check them. ``tiny-long`` is one
attention layer of width 64 with a 32k context: given a real model's tokenizer and chat
template (``tokenizer_from``), it evaluates a coding agent's 24,000-token prompt in seconds.)

The files load in llama.cpp (and llama-cpp-python) like any converted Llama model,
so workers exercise the real prefill/decode and KV-cache code paths without
downloading weights. Weights are drawn from a PCG64 stream seeded by
``(seed, tensor name)``: the same seed gives a byte-identical file, and tensors
can be generated one at a time, so even ``bench`` (~1.1B parameters, ~2.2 GB)
needs only one tensor in memory at a time.

Weight scales are chosen so that the prompt prefix matters. Untied, independent
``token_embd``/``output`` matrices stop the model from echoing its input token,
and Q/K weights with std ``qk_gain / sqrt(n_embd)`` (gain 2) give attention
scores with a std of about ``qk_gain**2`` = 4, so heads attend sharply to a few
earlier positions instead of averaging the whole prompt. Changing the first
token of a 100+ token prompt then moves the final logits by several units.

Tokenizer: an SPM (``tokenizer.ggml.model = "llama"``) vocabulary built by
:mod:`worker.models.vocab`. ``tokenizer.ggml.add_space_prefix`` is false, so
``detokenize(tokenize(text, add_bos=False)) == text`` for any UTF-8 text without
a literal U+2581 (``▁``). BOS (``<s>``, id 1) is added by the tokenizer
(``add_bos_token`` true); EOS is ``</s>``, id 2.

Chat template (``tokenizer.chat_template``) is ChatML-like::

    <|im_start|>{role}\\n{content}<|im_end|>\\n     (for every message)
    <|im_start|>assistant\\n                        (if add_generation_prompt)

``messages`` items need ``role`` and string ``content``. The role markers are
plain text, not special tokens: each tokenizes into at most two ordinary pieces
(a vocabulary piece named ``<|im_end|>`` would be promoted by llama.cpp to a
control token that detokenizes to nothing). A generation is ended by the
``<|im_end|>`` stop string or by EOS. The template does not emit ``bos_token``;
the tokenizer adds BOS. Note that llama-cpp-python's ``detokenize`` drops a
leading space when the first id is BOS, so round-trip text without the BOS.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from worker.models.borrow import Tokenizer, read_tokenizer
from worker.models.vocab import Vocab, build_vocab

if TYPE_CHECKING:
    import gguf

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CHUNK_ELEMENTS = 1 << 24
"""Random numbers are drawn in chunks of this many values to bound peak memory."""


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a generated model; ``dtype`` is the matrix weight type."""

    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    dtype: str = "f16"
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-5
    embd_std: float = 1.0
    qk_gain: float = 2.0
    out_gain: float = 2.0
    block_out_gain: float = 1.0
    """Scales the attention and feed-forward output matrices; with a tied output matrix the
    residual stream must move well away from the input token's embedding, or the model echoes it."""
    arch: str = "llama"
    """``llama``; or, for testing what kvpool cannot cut, ``cohere2`` (sliding-window attention) or ``mamba`` (recurrent)."""
    sliding_window: int = 32
    """``cohere2``: tokens each sliding-window layer sees."""
    swa_pattern: int = 2
    """``cohere2``: every ``swa_pattern``-th layer attends globally (Command R7B has 4, Gemma 2 has 2)."""
    ssm_state: int = 16
    """``mamba``: state size per channel (the inner size is twice ``n_embd``, as llama.cpp requires)."""
    ssm_conv: int = 4
    """``mamba``: convolution kernel width."""

    def __post_init__(self) -> None:
        if self.dtype not in ("f16", "f32"):
            raise ValueError(f"dtype must be 'f16' or 'f32', not {self.dtype!r}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
        if self.arch not in ("llama", "cohere2", "mamba", "jamba"):
            raise ValueError(f"arch must be 'llama', 'cohere2', 'mamba' or 'jamba', not {self.arch!r}")

    @property
    def ssm_dt_rank(self) -> int:
        return -(-self.n_embd // 16)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(shape)) for _, shape, _ in _tensor_plan(self))


_TINY = ModelSpec(name="tiny", n_vocab=2048, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512, n_ctx_train=4096)
SIZES: dict[str, ModelSpec] = {
    "tiny": _TINY,
    "bench": ModelSpec(name="bench", n_vocab=32000, n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632, n_ctx_train=4096),
    "tiny-swa": replace(_TINY, name="tiny-swa", block_out_gain=8.0, arch="cohere2"),
    "tiny-long": replace(_TINY, name="tiny-long", n_embd=64, n_layer=1, n_head=1, n_head_kv=1, n_ff=128, n_ctx_train=32768),
    "tiny-ssm": replace(_TINY, name="tiny-ssm", n_embd=128, n_layer=2, dtype="f32", arch="mamba"),
    "tiny-hybrid": replace(_TINY, name="tiny-hybrid", n_embd=128, n_ff=256, dtype="f32", arch="jamba"),
}

NEGATIVE_DECAY = -1.0
"""A `_tensor_plan` std that marks Mamba's ``A``: decay rates spread log-uniformly over
``-0.01 .. -0.0001``, never growth, so the state remembers the start of a long prompt."""


def _tensor_plan(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, numpy shape (rows=out, cols=in), std) per tensor; std 0 marks an all-ones norm.

    ``cohere2`` blocks run attention and feed-forward in parallel off one norm, and its
    output matrix is the token embedding.
    """
    if spec.arch == "mamba":
        return _mamba_plan(spec)
    if spec.arch == "jamba":
        return _jamba_plan(spec)
    d, kv, ff = spec.n_embd, spec.n_embd_kv, spec.n_ff
    inv = 1.0 / np.sqrt(d)
    plan: list[tuple[str, tuple[int, ...], float]] = [
        ("token_embd.weight", (spec.n_vocab, d), spec.embd_std),
    ]
    for i in range(spec.n_layer):
        plan += [
            (f"blk.{i}.attn_norm.weight", (d,), 0.0),
            (f"blk.{i}.attn_q.weight", (d, d), spec.qk_gain * inv),
            (f"blk.{i}.attn_k.weight", (kv, d), spec.qk_gain * inv),
            (f"blk.{i}.attn_v.weight", (kv, d), inv),
            (f"blk.{i}.attn_output.weight", (d, d), spec.block_out_gain * inv),
        ]
        if spec.arch == "llama":
            plan.append((f"blk.{i}.ffn_norm.weight", (d,), 0.0))
        plan += [
            (f"blk.{i}.ffn_gate.weight", (ff, d), inv),
            (f"blk.{i}.ffn_up.weight", (ff, d), inv),
            (f"blk.{i}.ffn_down.weight", (d, ff), spec.block_out_gain / np.sqrt(ff)),
        ]
    plan.append(("output_norm.weight", (d,), 0.0))
    if spec.arch == "llama":
        plan.append(("output.weight", (spec.n_vocab, d), spec.out_gain * inv))
    return plan


def _mamba_plan(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], float]]:
    """The tensors of llama.cpp's ``mamba`` architecture (``src/models/mamba.cpp``)."""
    d = spec.n_embd
    plan: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (spec.n_vocab, d), spec.embd_std)]
    for i in range(spec.n_layer):
        plan += [(f"blk.{i}.attn_norm.weight", (d,), 0.0), *_ssm_tensors(spec, i)]
    plan += [("output_norm.weight", (d,), 0.0), ("output.weight", (spec.n_vocab, d), spec.out_gain / np.sqrt(d))]
    return plan


def _ssm_tensors(spec: ModelSpec, i: int) -> list[tuple[str, tuple[int, ...], float]]:
    d, inner, state, rank = spec.n_embd, 2 * spec.n_embd, spec.ssm_state, spec.ssm_dt_rank
    return [
        (f"blk.{i}.ssm_in.weight", (2 * inner, d), 1.0 / np.sqrt(d)),
        (f"blk.{i}.ssm_conv1d.weight", (inner, spec.ssm_conv), 1.0 / np.sqrt(spec.ssm_conv)),
        (f"blk.{i}.ssm_conv1d.bias", (inner,), 0.1),
        (f"blk.{i}.ssm_x.weight", (rank + 2 * state, inner), 3.0 / np.sqrt(inner)),
        (f"blk.{i}.ssm_dt.weight", (inner, rank), 1.0 / np.sqrt(rank)),
        (f"blk.{i}.ssm_dt.bias", (inner,), 0.5),
        (f"blk.{i}.ssm_a", (inner, state), NEGATIVE_DECAY),
        (f"blk.{i}.ssm_d", (inner,), 0.0),
        (f"blk.{i}.ssm_out.weight", (d, inner), spec.block_out_gain / np.sqrt(inner)),
    ]


def jamba_kv_heads(spec: ModelSpec) -> list[int]:
    """``jamba``: KV heads per layer; 0 marks a Mamba layer (every other one, starting with the first)."""
    return [0 if i % 2 == 0 else spec.n_head_kv for i in range(spec.n_layer)]


def _jamba_plan(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], float]]:
    """The tensors of llama.cpp's ``jamba`` architecture (``src/models/jamba.cpp``): Mamba and attention layers, each with a dense FFN."""
    d, kv, ff, inv = spec.n_embd, spec.n_embd_kv, spec.n_ff, 1.0 / np.sqrt(spec.n_embd)
    plan: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (spec.n_vocab, d), spec.embd_std)]
    for i, heads in enumerate(jamba_kv_heads(spec)):
        plan.append((f"blk.{i}.attn_norm.weight", (d,), 0.0))
        if heads == 0:
            plan += _ssm_tensors(spec, i)
            plan += [(f"blk.{i}.ssm_dt_norm.weight", (spec.ssm_dt_rank,), 0.0)]
            plan += [(f"blk.{i}.ssm_b_norm.weight", (spec.ssm_state,), 0.0), (f"blk.{i}.ssm_c_norm.weight", (spec.ssm_state,), 0.0)]
        else:
            plan += [
                (f"blk.{i}.attn_q.weight", (d, d), spec.qk_gain * inv),
                (f"blk.{i}.attn_k.weight", (kv, d), spec.qk_gain * inv),
                (f"blk.{i}.attn_v.weight", (kv, d), inv),
                (f"blk.{i}.attn_output.weight", (d, d), spec.block_out_gain * inv),
            ]
        plan += [
            (f"blk.{i}.ffn_norm.weight", (d,), 0.0),
            (f"blk.{i}.ffn_gate.weight", (ff, d), inv),
            (f"blk.{i}.ffn_up.weight", (ff, d), inv),
            (f"blk.{i}.ffn_down.weight", (d, ff), spec.block_out_gain / np.sqrt(ff)),
        ]
    plan += [("output_norm.weight", (d,), 0.0), ("output.weight", (spec.n_vocab, d), spec.out_gain * inv)]
    return plan


def _tensor_dtype(spec: ModelSpec, shape: tuple[int, ...]) -> type[np.floating]:
    """llama.cpp keeps 1-D tensors (norms) in f32 even in f16 files."""
    return np.float16 if spec.dtype == "f16" and len(shape) > 1 else np.float32


def _rng(seed: int, name: str) -> np.random.Generator:
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, name_key])))


def _make_tensor(seed: int, name: str, shape: tuple[int, ...], std: float, dtype: type[np.floating]) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    if std == 0.0:
        flat[:] = 1.0
        return out
    rng = _rng(seed, name)
    if std == NEGATIVE_DECAY:
        flat[:] = -np.exp(rng.uniform(np.log(1e-4), np.log(1e-2), flat.size))
        return out
    for start in range(0, flat.size, _CHUNK_ELEMENTS):
        chunk = rng.standard_normal(min(_CHUNK_ELEMENTS, flat.size - start), dtype=np.float32)
        chunk *= np.float32(std)
        flat[start : start + chunk.size] = chunk
    return out


def _gguf() -> ModuleType:
    """The gguf package, which writes the files: an extra (``kvpool[synth]``), since only generated models need it."""
    try:
        import gguf
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"generating a model needs the gguf package: pip install 'kvpool[synth]' ({e})", name=e.name) from None
    return gguf


def _add_metadata(writer: gguf.GGUFWriter, spec: ModelSpec, vocab: Vocab | Tokenizer, seed: int) -> None:
    file_type = _gguf().LlamaFileType
    writer.add_name(f"kvpool-{spec.name}")
    writer.add_file_type(file_type.MOSTLY_F16 if spec.dtype == "f16" else file_type.ALL_F32)
    writer.add_uint64("kvpool.seed", seed)
    writer.add_vocab_size(spec.n_vocab)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    if spec.arch in ("mamba", "jamba"):
        writer.add_feed_forward_length(spec.n_ff if spec.arch == "jamba" else 0)
        writer.add_head_count(spec.n_head if spec.arch == "jamba" else 0)
        if spec.arch == "jamba":
            writer.add_head_count_kv(jamba_kv_heads(spec))
        writer.add_ssm_conv_kernel(spec.ssm_conv)
        writer.add_ssm_inner_size(2 * spec.n_embd)
        writer.add_ssm_state_size(spec.ssm_state)
        writer.add_ssm_time_step_rank(spec.ssm_dt_rank)
    else:
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(spec.rope_freq_base)
    if spec.arch == "cohere2":
        writer.add_layer_norm_eps(spec.rms_norm_eps)
        writer.add_sliding_window(spec.sliding_window)
        writer.add_sliding_window_pattern(spec.swa_pattern)
        writer.add_logit_scale(1.0)
    else:
        writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    if isinstance(vocab, Tokenizer):
        return vocab.write(writer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _resolve(spec: ModelSpec | str) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    try:
        return SIZES[spec]
    except KeyError:
        raise ValueError(f"unknown model size {spec!r}; known: {', '.join(sorted(SIZES))}") from None


def make_model(spec: ModelSpec | str, path: Path, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """Write the model for ``spec`` and ``seed`` to ``path`` atomically and return ``path``.

    With ``tokenizer_from`` (a GGUF model), the model has that model's tokenizer and chat
    template (`worker.models.borrow`) instead of the generated ones, and its vocabulary size.
    """
    spec = _resolve(spec)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, not {seed}")
    writers = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab: Vocab | Tokenizer = build_vocab(spec.n_vocab) if tokenizer_from is None else read_tokenizer(tokenizer_from)
    if isinstance(vocab, Tokenizer):
        spec = replace(spec, n_vocab=vocab.n_vocab)
    plan = _tensor_plan(spec)

    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        tmp.chmod(0o644)
        writer = writers.GGUFWriter(tmp, spec.arch)
        try:
            _add_metadata(writer, spec, vocab, seed)
            for name, shape, _ in plan:
                dtype = np.dtype(_tensor_dtype(spec, shape))
                writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, shape, std in plan:
                writer.write_tensor_data(_make_tensor(seed, name, shape, std, _tensor_dtype(spec, shape)))
            for fout in writer.fout or ():
                fout.flush()
                os.fsync(fout.fileno())
        finally:
            writer.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def model_filename(size: str, seed: int = 0) -> str:
    return f"kvpool-{size}-s{seed}.gguf"


def ensure_model(size: str, cache_dir: Path, seed: int = 0) -> Path:
    """Return the cached model ``cache_dir/kvpool-{size}-s{seed}.gguf``, generating it if absent."""
    path = Path(cache_dir) / model_filename(size, seed)
    if not path.exists():
        make_model(_resolve(size), path, seed)
    return path

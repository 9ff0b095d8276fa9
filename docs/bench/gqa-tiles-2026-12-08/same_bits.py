"""A digest of every logit llama.cpp computes for SmolLM2 in a worker's layout, to compare two builds bit for bit.

One context as a worker opens it (a KV stream per sequence, flash attention, 2 threads);
each sequence gets a random prompt of the given length (in pieces of up to 512 tokens, its
last logits kept), then 96 rounds decode one greedy token of every sequence in one batch.
The digest covers every logit kept. The same digest from two builds: the same bits.

    python same_bits.py 300 700 1100 1500                           # 4 sequences, the build installed
    PYTHONPATH=DIR python same_bits.py 1500                         # 1 sequence, the wheel unpacked in DIR
"""

import hashlib
import sys
from pathlib import Path

import llama_cpp
import numpy as np

MODEL = Path(__file__).resolve().parents[3] / ".kvpool" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    lens = [int(x) for x in sys.argv[1:]] or [300, 700, 1100, 1500]
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(MODEL).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = len(lens) * 2048, 512, 512, len(lens), False
    cp.flash_attn_type, cp.n_threads, cp.n_threads_batch = 1, 2, 2
    ctx = llama_cpp.llama_init_from_model(model, cp)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(items: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """(sequence, tokens, first position) in one batch: each item's last logits."""
        i = 0
        for seq, toks, p in items:
            for j, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p + j, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if j == len(toks) - 1 else 0
                i += 1
        batch.n_tokens = i
        assert llama_cpp.llama_decode(ctx, batch) == 0
        outs, k = [], 0
        for _, toks, _ in items:
            k += len(toks)
            outs.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, k - 1), shape=(n_vocab,)).copy())
        return outs

    digest, rng = hashlib.sha256(), np.random.default_rng(7)
    pos, last = [], []
    for s, n in enumerate(lens):
        toks, p = rng.integers(100, n_vocab - 100, n).tolist(), 0
        while p < n:
            out = decode([(s, toks[p : p + 512], p)])[0]
            p = min(p + 512, n)
        digest.update(out.tobytes())
        pos.append(n)
        last.append(int(out.argmax()))
    for _ in range(96):
        outs = decode([(s, [last[s]], pos[s]) for s in range(len(lens))])
        for s, out in enumerate(outs):
            digest.update(out.tobytes())
            pos[s] += 1
            last[s] = int(out.argmax())
    print(f"{len(lens)} sequences {lens}: {digest.hexdigest()}")


if __name__ == "__main__":
    main()

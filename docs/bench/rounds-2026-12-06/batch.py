"""The probes' one helper: a llama.cpp batch of several sequences' tokens, logits for each one's last."""

import llama_cpp


def fill(b, items):
    """Write ``items`` ((sequence, tokens, first position) each) into batch ``b``; the batch's size."""
    i = 0
    for seq, toks, p0 in items:
        for j, t in enumerate(toks):
            b.token[i] = t
            b.pos[i] = p0 + j
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if j == len(toks) - 1 else 0
            i += 1
    b.n_tokens = i
    return i


def new_batch():
    return llama_cpp.llama_batch_init(512, 0, 1)

"""Deterministic SentencePiece-style ("llama"/SPM) vocabulary for the generated models.

The vocabulary is laid out the way llama.cpp expects an SPM vocab to be:

* ids 0, 1, 2: ``<unk>`` (UNKNOWN), ``<s>`` and ``</s>`` (CONTROL);
* ids 3..258: the byte-fallback tokens ``<0x00>``..``<0xFF>`` (BYTE), so any
  UTF-8 input can be encoded even when no piece covers it;
* every character of the embedded sample text as a one-character piece;
* pieces learned by byte-pair merging over the sample text, most frequent first;
* no piece spells a whole ``<...>`` tag, so chat markers such as ``<|im_end|>``
  stay plain text (two pieces) instead of being promoted to control tokens;
* if the requested size is still not reached (the sample only supports a few
  thousand merges), "filler" pieces that concatenate two learned pieces.

Spaces are written as ``▁`` (U+2581) inside pieces. Scores fall with the rank of
a piece: llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose
concatenation is the highest-scoring piece, which replays the learned merges.
Because every piece decodes to exactly its own text, ``detokenize(tokenize(s))``
returns ``s`` for any UTF-8 string provided the model does not add a space prefix
(``tokenizer.ggml.add_space_prefix = false``) and ``s`` contains no literal ``▁``,
which SPM cannot tell apart from a space.
"""

from __future__ import annotations

import functools
import heapq
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from enum import IntEnum

SPACE = "\u2581"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
MAX_PIECE_CHARS = 16
"""llama-cpp-python detokenizes through a 32-byte buffer per token; stay well under it."""
_TAG = re.compile(rf"{SPACE}?<[^<>]*>")
"""Pieces never spell a whole tag: llama.cpp turns pieces named like ``<|im_end|>`` or
``<|endoftext|>`` into CONTROL/end-of-generation tokens, which detokenize to nothing."""


class TokenType(IntEnum):
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __len__(self) -> int:
        return len(self.tokens)


SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. This is a small sample of English text that we use to \
learn a vocabulary for a test model. It is not meant to be beautiful; it only has to contain the \
words, numbers and punctuation that people type every day, so that a tokenizer trained on it turns \
common words into a few pieces instead of one piece per byte.

Once upon a time there was a little town by the sea. The people who lived there were fishermen, \
bakers, teachers and children. Every morning the bakers made fresh bread, and the smell of it went \
through the streets before the sun came up. The children walked to school, the teachers opened the \
doors, and the fishermen went out on their boats. In the evening they all came back home, had \
dinner with their families and talked about what had happened during the day.

A computer is a machine that can be programmed to carry out sequences of arithmetic or logical \
operations. Modern computers can perform general sets of operations known as programs. These \
programs enable computers to perform a wide range of tasks. A computer system is a complete \
computer that includes the hardware, the operating system, and the peripheral equipment needed \
and used for full operation. The memory of a computer stores data and instructions, while the \
processor reads them, performs the work and writes the results back.

Language models read text as a sequence of tokens. Each token is a number, and the model learns \
which number is likely to come next. When you send a prompt to a server, the server first turns \
the text into tokens, then it computes the attention keys and values for every token in the \
prompt. This work is called the prefill. If two requests share the same prefix, the keys and \
values of that prefix can be computed once, stored in a cache, and shared between workers. A \
shared cache saves time, memory and energy, and it makes the first token of the answer appear \
much sooner.

Here are some numbers: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 32, 42, 64, 100, 128, 256, \
512, 1000, 1024, 2048, 4096, 2023, 2024, 2025, 3.14, 2.71, 0.5, 99%, $15.00, 10:30, 1st, 2nd, 3rd.
Dates look like 2024-05-17 and times look like 09:45:00. Phone numbers look like (555) 123-4567.

Questions and answers:
What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week.
Why is the sky blue? Because the air scatters blue light more than red light.
Where do you want to go? I would like to go to the park, if the weather is nice.
Can you help me with my homework? Of course, I can help you. What is the question?
Please write a short story about a cat and a dog who become friends.
Thank you very much! You're welcome. Have a good day, and see you tomorrow.

<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Hello! Can you tell me a joke?<|im_end|>
<|im_start|>assistant
Why did the computer go to the doctor? Because it had a virus!<|im_end|>
<|im_start|>user
What is the weather like today?<|im_end|>
<|im_start|>assistant
I do not know the weather today, but I hope it is sunny where you are.<|im_end|>
<|im_start|>system
You are a careful assistant who answers in one sentence.<|im_end|>
<|im_start|>user
Summarize the story in one sentence, please.<|im_end|>
<|im_start|>assistant
A small town wakes up, works hard all day, and comes home in the evening.<|im_end|>

def add(a, b):
    return a + b

for i in range(10):
    print("value:", i, "square:", i * i)

if x == 0 and y != 1:
    result = {"name": "test", "count": 3, "items": [1, 2, 3]}

The weather was cold and wet in the north, but warm and dry in the south. People were \
talking about the news, the prices, the football game and the new film that everyone wanted to \
see. She said that she would call him later. He said that he could not come because he was busy. \
They agreed to meet on Friday at the old café near the station, where the coffee is good and the \
cakes are even better. It was a naïve plan, but it worked: they met, they laughed, and they \
stayed until the café closed.

Good writing is clear and simple. Use short sentences. Choose the right word, not the longest \
word. Read your text again before you send it, and remove everything that does not help the \
reader. When you explain something, start with an example, then give the general rule, and end \
with another example. Important things should come first; details can come later.

The history of science is full of people who asked simple questions. Why does an apple fall? How \
far away is the moon? What is light made of? Each answer opened new questions, and each new \
question needed better tools, better measurements and better ideas. Today we know much more than \
we did a hundred years ago, but there are still many things that we do not understand.

To make a simple soup, cut two onions, three carrots and a few potatoes into small pieces. Heat \
some oil in a large pot, add the onions and cook them slowly until they are soft. Then add the \
other vegetables, cover them with water, add salt and pepper, and let everything boil for about \
twenty minutes. Serve the soup hot with a piece of bread. If you want, you can add a little cream \
or fresh herbs at the end.

Dear Anna, thank you for your letter. I was very happy to hear from you. We arrived in the city \
last week and the first days were busy, because we had to find a flat, open a bank account and \
buy many small things for the kitchen. Now we are settled, and I have time to write. The city is \
large and loud, but the parks are beautiful and the museums are free on Sundays. I hope you can \
visit us in the summer. Write soon and give my love to your family. Best wishes, Tom.

Error: file not found. Warning: the value is too large. Note: this function returns a list of \
strings. Usage: run the command with the --help option to see all available options. The server \
started on port 8080 and is ready to accept requests from clients.
"""


def _pretokenize(text: str) -> list[str]:
    """Split escaped text into the units BPE may merge within (a space attaches to the next word)."""
    pattern = (
        r"<\|im_(?:start|end)\|>"  # chat template role markers, learned as whole units
        rf"|{SPACE}?[^\W\d_]+"  # letters, optionally preceded by a space
        rf"|{SPACE}?\d"  # digits stay single, like llama's split_digits
        rf"|{SPACE}?(?:(?!<\|im_)[^\w\s{SPACE}])+"  # runs of punctuation/symbols
        rf"|{SPACE}+"
        r"|[\s\S]"
    )
    return re.findall(pattern, text)


def _learn_merges(words: Counter[tuple[str, ...]], limit: int) -> list[str]:
    """Byte-pair encoding on character sequences; returns new pieces in merge order.

    Ties are broken by the pair's text so the result never depends on hashing or dict order.
    """
    seqs = [list(w) for w in words]
    freqs = list(words.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)

    heap = [(-c, a + b, a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)
    merged: list[str] = []
    known: set[str] = {c for seq in seqs for c in seq}
    banned: set[tuple[str, str]] = set()
    while heap and len(merged) < limit:
        neg, _, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b), 0) != -neg or neg == 0:
            continue
        piece = a + b
        del pair_counts[(a, b)]
        if len(piece) > MAX_PIECE_CHARS or _TAG.fullmatch(piece):
            banned.add((a, b))
            continue
        if piece not in known:
            merged.append(piece)
            known.add(piece)
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop((a, b), ())):
            seq, f = seqs[i], freqs[i]
            for pair in zip(seq, seq[1:]):
                if pair != (a, b):
                    pair_counts[pair] -= f
                    touched.add(pair)
            out: list[str] = []
            j = 0
            while j < len(seq):
                if j + 1 < len(seq) and seq[j] == a and seq[j + 1] == b:
                    out.append(piece)
                    j += 2
                else:
                    out.append(seq[j])
                    j += 1
            seqs[i] = out
            for pair in zip(out, out[1:]):
                pair_counts[pair] += f
                where[pair].add(i)
                touched.add(pair)
        for pair in sorted(touched):
            count = pair_counts.get(pair, 0)
            if count > 0 and pair not in banned:
                heapq.heappush(heap, (-count, pair[0] + pair[1], pair[0], pair[1]))
            else:
                pair_counts.pop(pair, None)
    return merged


def _fillers(pieces: list[str], known: set[str], n: int) -> list[str]:
    """Pieces made of a word start and a continuation, best-ranked combinations first."""
    starts = [p for p in pieces if p.startswith(SPACE) and p[1:].isalpha()]
    conts = [p for p in pieces if p.isalpha() and p.islower()]
    out: list[str] = []
    total = 0
    while len(out) < n and total <= len(starts) + len(conts):
        for i in range(max(0, total - len(conts) + 1), min(total + 1, len(starts))):
            piece = starts[i] + conts[total - i]
            if len(piece) <= MAX_PIECE_CHARS and piece not in known:
                known.add(piece)
                out.append(piece)
                if len(out) == n:
                    break
        total += 1
    if len(out) < n:
        raise ValueError(f"cannot build {n} filler pieces from the sample text")
    return out


@functools.cache
def build_vocab(n_vocab: int) -> Vocab:
    """Build the vocabulary of exactly ``n_vocab`` tokens (deterministic, cached per size)."""
    specials = [UNK, BOS, EOS]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = Counter(tuple(w) for w in _pretokenize(SAMPLE_TEXT.replace(" ", SPACE)) if w != "\n")
    chars = sorted({c for w in words for c in w})
    fixed = len(specials) + len(byte_tokens) + len(chars)
    if n_vocab < fixed:
        raise ValueError(f"n_vocab must be at least {fixed}")
    merged = _learn_merges(words, n_vocab - fixed)
    known = set(chars) | set(merged)
    fillers = _fillers(merged, known, n_vocab - fixed - len(merged))
    pieces = chars + merged + fillers
    tokens = specials + byte_tokens + pieces
    types = (
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * len(byte_tokens) + [TokenType.NORMAL] * len(pieces)
    )
    scores = [0.0] * (len(specials) + len(byte_tokens)) + [-float(i) for i in range(len(pieces))]
    return Vocab(tuple(tokens), tuple(scores), tuple(int(t) for t in types))

"""A tiny random-weight Llama for llama.cpp's llama-server: real tokens through a real engine, in a few MB.

    python -m testkit.tiny_llama OUT.gguf [--gguf-py DIR]

What it is (every number fixed, and the weights drawn from one seed, so every run writes the same bytes):
- Architecture `llama`: 4 blocks, embedding 256, 4 attention heads of 64 (no grouped KV), SwiGLU feed-forward 768,
  RMSNorm (eps 1e-5), RoPE over the whole head (base 10000), a 2,048-token context, no tied output.
- Tokenizer `gpt2` (byte-level BPE with GPT-2's regex pre-tokenizer): the 256 byte tokens in GPT-2's byte-to-unicode
  spelling, then MERGES (common English pairs, each merge's result a token), then three control tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`: 256 + len(MERGES) + 3 tokens. Any text tokenizes.
- Chat template: ChatML, as a Jinja template (llama-server renders it with its own Jinja engine).
- Weights: F16 matrices, F32 norms; a normal draw with std 0.02 (embeddings 1.0), numpy's PCG64 at SEED.

It can only say printable ASCII. Random weights would pick byte tokens above 0x7F (half a UTF-8 character, which
the server holds back until the character completes, so a stream's events would not be its tokens) and the
control tokens (an early end). So dimension 0 of the residual stream is a constant: every embedding has
CARRIER there, and no attention or feed-forward output writes to it; the output matrix's column 0 is -PENALTY for
those tokens and 0 for the others. After the final norm dimension 0 is always large and positive, so their logits
sit far below every other token's whatever the input: a completion is exactly `max_tokens` tokens, one event each.

The tests generate it at run time into a temporary directory (tests/integration/llamacpp.py), with the gguf-py that
ships in the same llama.cpp source as the engine reading the file (scripts/llama-server.sh), so the format, keys
and tensor names are the engine's own by construction; a gguf release from PyPI follows llama.cpp's master on its
own schedule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

SEED = 20261201
LAYERS, WIDTH, HEADS, FFN, CONTEXT = 4, 256, 4, 768, 2048
RMS_EPS, ROPE_BASE = 1e-5, 10000.0
CARRIER, PENALTY = 4.0, 100.0
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Pairs of tokens that BPE merges, in order (the result of each is a token too). Enough that English-like prompts
# take fewer tokens than bytes, as with a real tokenizer; "Ġ" is GPT-2's spelling of a space.
MERGES = (
    "Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġ s", "a t", "e n", "n d", "Ġ o", "e s", "Ġ w",
    "o r", "t e", "e d", "i s", "i t", "a r", "a l", "Ġt he", "Ġ c", "Ġ b", "Ġ f", "Ġ p", "Ġ m", "in g", "o u",
    "l e", "s t", "Ġ d", "Ġ h", "i c", "Ġ in", "Ġa nd", "Ġo f", "Ġt o", "a s", "i on", "l l", "o m", "v e",
    "Ġ l", "r o", "Ġ re", "t h", "c h", "l y",
)


def byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map, in byte order: what byte-level BPE vocabularies spell."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[str], list[bool]]:
    """Tokens, merges, and per token whether it may be generated (its text is printable ASCII)."""
    alphabet = byte_alphabet()
    tokens = list(alphabet)
    speakable = [0x20 <= b <= 0x7E for b in range(256)]
    for merge in MERGES:
        a, b = merge.split(" ")
        assert a in tokens and b in tokens, merge
        tokens.append(a + b)
        speakable.append(True)  # merges of printable ASCII
    tokens += SPECIALS
    assert len(set(tokens)) == len(tokens)
    speakable += [False] * len(SPECIALS)
    return tokens, list(MERGES), speakable


def load_gguf(gguf_py: Path | None) -> ModuleType:
    if gguf_py is not None:
        sys.path.insert(0, str(gguf_py))
    import gguf

    return gguf


def write(out: Path, gguf_py: Path | None = None) -> Path:
    import numpy as np

    gguf = load_gguf(gguf_py)
    tokens, merges, speakable = vocabulary()
    n_vocab = len(tokens)
    rng = np.random.Generator(np.random.PCG64(SEED))

    def matrix(rows: int, cols: int, std: float = 0.02) -> "np.ndarray":
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("qosagent tiny llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(WIDTH)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(WIDTH // HEADS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (n_vocab - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    w.add_token_merges(merges)
    eot, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    w.add_bos_token_id(eot)
    w.add_eos_token_id(im_end)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def f16(name: str, a: "np.ndarray") -> None:
        w.add_tensor(name, a.astype(np.float16))

    def f32(name: str, a: "np.ndarray") -> None:
        w.add_tensor(name, a.astype(np.float32))

    embd = matrix(n_vocab, WIDTH, 1.0)
    embd[:, 0] = CARRIER
    f16("token_embd.weight", embd)
    for i in range(LAYERS):
        f32(f"blk.{i}.attn_norm.weight", np.ones(WIDTH, np.float32))
        for part in ("attn_q", "attn_k", "attn_v"):
            f16(f"blk.{i}.{part}.weight", matrix(WIDTH, WIDTH))
        wo = matrix(WIDTH, WIDTH)
        wo[0, :] = 0.0  # nothing writes to the carrier dimension
        f16(f"blk.{i}.attn_output.weight", wo)
        f32(f"blk.{i}.ffn_norm.weight", np.ones(WIDTH, np.float32))
        f16(f"blk.{i}.ffn_gate.weight", matrix(FFN, WIDTH))
        f16(f"blk.{i}.ffn_up.weight", matrix(FFN, WIDTH))
        down = matrix(WIDTH, FFN)
        down[0, :] = 0.0
        f16(f"blk.{i}.ffn_down.weight", down)
    f32("output_norm.weight", np.ones(WIDTH, np.float32))
    head = matrix(n_vocab, WIDTH, 0.1)
    head[:, 0] = [0.0 if ok else -PENALTY for ok in speakable]
    f16("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gguf-py", type=Path, help="llama.cpp's gguf-py directory (default: an installed gguf)")
    args = ap.parse_args()
    write(args.out, args.gguf_py)
    print(args.out)


if __name__ == "__main__":
    main()

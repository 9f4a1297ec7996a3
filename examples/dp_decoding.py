"""Differentially private decoding with a KerasHub GPT-2, fully offline.

Builds a tiny GPT-2 with a locally trained byte-level BPE tokenizer, trains it
briefly (non-privately) on Shakespeare (or a built-in paragraph when the corpus
is not fetched), then generates with ``DPSampler``: each new token is drawn
from ``lambda*q + (1-lambda)*uniform`` and the output sequence is
epsilon-DP with respect to everything that went into the model's predictions.
A ``DecodingBudget`` refuses, before generating, a call that would exceed it.

    python examples/dp_decoding.py              # ~1-2 min on 2 CPU cores
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
try:
    import keras_dp_lm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keras_dp_lm import testing  # noqa: E402
from keras_dp_lm.samplers import (BudgetExhaustedError, DecodingBudget,  # noqa: E402
                                  DPSampler, lambda_for_epsilon, vocabulary_size_of)

MAX_LENGTH = 32          # prompt + new tokens
SEQUENCE_EPSILON = 200.0  # target epsilon for one generated sequence (see README: large)
PROMPTS = ["HAMLET.\nTo be, or not", "KING.\nMy lord,"]


def main():
    causal_lm = testing.tiny_gpt2_causal_lm(vocabulary_size=512, num_layers=2,
                                            hidden_dim=64, num_heads=2,
                                            intermediate_dim=128, sequence_length=64)
    history = testing.fit_briefly(causal_lm, steps=150, batch_size=16)
    print(f"trained 150 steps, loss {history.history['loss'][-1]:.2f}")

    vocabulary_size = vocabulary_size_of(causal_lm)
    prompt_tokens = causal_lm.preprocessor.generate_preprocess(
        PROMPTS, sequence_length=MAX_LENGTH)["padding_mask"].numpy().sum(-1).min()
    new_tokens = MAX_LENGTH - int(prompt_tokens)     # what is charged (the maximum)
    lambda_ = lambda_for_epsilon(SEQUENCE_EPSILON, vocabulary_size, new_tokens)
    sampler = DPSampler(lambda_=lambda_)             # seed from OS entropy
    causal_lm.compile(sampler=sampler, jit_compile=True)
    print(f"|V|={vocabulary_size}, {new_tokens} new tokens, lambda_={lambda_:.4f}: "
          f"epsilon {sampler.epsilon_per_token(vocabulary_size):.3f} per token, "
          f"{sampler.epsilon_per_sequence(vocabulary_size, new_tokens):.2f} per sequence")

    budget = DecodingBudget(total_epsilon=2.5 * SEQUENCE_EPSILON)
    for call in range(3):
        try:
            outputs = budget.generate(causal_lm, PROMPTS, max_length=MAX_LENGTH)
        except BudgetExhaustedError as error:
            print(f"call {call + 1}: refused before generating -> {error}")
            break
        print(f"call {call + 1}: spent {budget.spent:.2f} of {budget.total_epsilon:g}")
        for text in outputs:
            print("   ", repr(text))

    # For comparison: the non-private model alone (lambda_ -> 1 is not allowed;
    # KerasHub's RandomSampler samples from q itself).
    causal_lm.compile(sampler="random", jit_compile=True)
    print("non-private:", [repr(t) for t in causal_lm.generate(PROMPTS, max_length=MAX_LENGTH)])


if __name__ == "__main__":
    main()

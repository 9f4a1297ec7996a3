"""Privacy accounting for DP training, all of it computed by ``dp_accounting``.

One DP-SGD update with Poisson sampling rate ``q`` and noise multiplier
``sigma`` is the ``dp_accounting`` event
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; ``n`` updates are that
event self-composed ``n`` times. Epsilon comes from ``dp_accounting``'s PLD
accountant (default: tight) or its RDP accountant (looser, cheap), for
add/remove-one adjacency.

Other releases about the same data (``DpEvent`` objects or ``(epsilon,
delta)`` pairs) compose with training in the same accountant
(:func:`compose_epsilon`, and ``extra_events=`` of :func:`epsilon_curve` and
:func:`calibrate_noise_multiplier`). :func:`epsilon_curve` gives epsilon after
many step counts from one PLD built once; every number a guarantee rests on
(``compute_epsilon``, ``compose_epsilon``, the answers of ``max_steps`` and
``calibrate_noise_multiplier``) is computed by a fresh accountant.

This package imports neither TensorFlow nor Keras: planning a run
(``keras-dp-lm epsilon``, :func:`calibrate_noise_multiplier`) is plain
arithmetic. The Keras callback is :class:`keras_dp_lm.callbacks.PrivacyAccountant`.

Example:
    >>> from keras_dp_lm import accounting
    >>> eps = accounting.compute_epsilon(noise_multiplier=1.1, sampling_rate=256 / 60000,
    ...                                  steps=14070, delta=1e-5)
    >>> round(eps, 2)
    2.38
    >>> vocab = (1.0, 5e-7)  # e.g. a DP vocabulary, (epsilon, delta)
    >>> sigma = accounting.calibrate_noise_multiplier(8.0, 1e-6, sampling_rate=0.01,
    ...                                               steps=1000, extra_events=[vocab])
    >>> curve = accounting.epsilon_curve(sigma, 0.01, [250, 500, 1000], 1e-6,
    ...                                  extra_events=[vocab])
    >>> curve[0] < curve[1] < curve[2] <= 8.0
    True
"""


from keras_dp_lm.accounting._arguments import ACCOUNTANTS
from keras_dp_lm.accounting._arguments import PrivacyBudgetExhaustedError
from keras_dp_lm.accounting.calibration import calibrate_noise_multiplier
from keras_dp_lm.accounting.epsilon import compose_epsilon
from keras_dp_lm.accounting.epsilon import compute_epsilon
from keras_dp_lm.accounting.epsilon import epsilon_curve
from keras_dp_lm.accounting.epsilon import ledger_epsilon
from keras_dp_lm.accounting.epsilon import max_steps
from keras_dp_lm.accounting.events import EpsilonDeltaDpEvent
from keras_dp_lm.accounting.events import dp_sgd_event
from keras_dp_lm.accounting.events import LedgerRow
from keras_dp_lm.accounting.events import ledger_events
from keras_dp_lm.accounting.events import make_accountant
from keras_dp_lm.accounting.report import privacy_report
from keras_dp_lm.accounting.report import privacy_statement
from keras_dp_lm.accounting.report import report_to_json
from keras_dp_lm.accounting.user_level import user_level_epsilon

__all__ = [
    "ACCOUNTANTS",
    "EpsilonDeltaDpEvent",
    "PrivacyBudgetExhaustedError",
    "calibrate_noise_multiplier",
    "compose_epsilon",
    "compute_epsilon",
    "dp_sgd_event",
    "epsilon_curve",
    "ledger_epsilon",
    "LedgerRow",
    "ledger_events",
    "make_accountant",
    "max_steps",
    "privacy_report",
    "privacy_statement",
    "report_to_json",
    "user_level_epsilon",
]

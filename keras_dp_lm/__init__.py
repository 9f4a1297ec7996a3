"""keras_dp_lm: differentially private vocabularies, training and decoding for Keras 3.

Importing the package patches ``keras.Model.compile`` so that compiling with a DP
optimizer binds the DP train step: ``model.fit`` then trains privately.
"""

__version__ = "0.1.0"

from keras_dp_lm import accounting
from keras_dp_lm import evaluation
from keras_dp_lm import sampling
from keras_dp_lm import training as _training
from keras_dp_lm import vocab
from keras_dp_lm.accounting import PrivacyAccountant
from keras_dp_lm.accounting import PrivacyBudgetExhaustedError
from keras_dp_lm.accounting import calibrate_noise_multiplier
from keras_dp_lm.accounting import compute_epsilon
from keras_dp_lm.accounting import max_steps
from keras_dp_lm.generation import BudgetExhaustedError
from keras_dp_lm.generation import DecodingBudget
from keras_dp_lm.generation import DPSampler
from keras_dp_lm.generation import epsilon_per_sequence
from keras_dp_lm.generation import epsilon_per_token
from keras_dp_lm.generation import lambda_for_epsilon
from keras_dp_lm.losses import per_example_losses
from keras_dp_lm.optimizers import DPAdam
from keras_dp_lm.optimizers import DPAdamW
from keras_dp_lm.optimizers import DPOptimizerMixin
from keras_dp_lm.optimizers import DPSGD
from keras_dp_lm.optimizers import is_dp_optimizer
from keras_dp_lm.optimizers import make_dp_optimizer
from keras_dp_lm.sampling import poisson_batches
from keras_dp_lm.sampling import suggest_max_batch_size
from keras_dp_lm.training import make_private
from keras_dp_lm.vocab import DPVocabularyAdapter

_training.install()

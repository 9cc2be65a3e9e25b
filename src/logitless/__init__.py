"""logitless: losses and log-probabilities at the head of a language model without the N x V logits tensor."""

from . import distributed as distributed  # logitless.distributed: the vocabulary-parallel ops with their layout given
from .cross_entropy import cross_entropy
from .distill import linear_jsd, linear_kl_div, linear_soft_cross_entropy
from .integrations.hf import patch, unpatch
from .linear_cross_entropy import linear_cross_entropy
from .log_probs import linear_log_probs, linear_logsumexp
from .nn import CrossEntropyLoss, LinearCrossEntropyLoss
from .sorted_head import SortedHead
from .vocab import VocabOrder

__version__ = "0.1.0"

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "SortedHead",
    "VocabOrder",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_jsd",
    "linear_kl_div",
    "linear_log_probs",
    "linear_logsumexp",
    "linear_soft_cross_entropy",
    "patch",
    "unpatch",
]

"""What a user configures, and the checks it passes: the vocabulary of the public API (strategies,
policies, ``bucket=``, single values' checks, and :class:`BackendOptions`, every option declared
once). It sits at the bottom of the package: nothing here imports the rest of it but ``errors``.
"""

from ..errors import ConfigError as ConfigError  # the options module is where users have imported it from
from .buckets import BucketPolicy, Policy, parse_policy
from .options import BackendOptions, documents_options, option, options_doc, signature_from
from .policies import COMMUNICABLE_DTYPES, CPUOffload, MixedPrecision
from .strategy import ShardingStrategy
from .values import OPTIONAL_PASSES, ReshardOption, check_inflight_budget, check_prefetch, env_flag

__version__ = "0.1.0"  # the one definition; readers look it up when they need it

__all__ = ["COMMUNICABLE_DTYPES", "OPTIONAL_PASSES", "BackendOptions", "BucketPolicy", "CPUOffload", "ConfigError",
           "MixedPrecision", "Policy", "ReshardOption", "ShardingStrategy", "check_inflight_budget", "check_prefetch",
           "documents_options", "env_flag", "option", "options_doc", "parse_policy", "signature_from"]

"""Your own callbacks: small worked examples to copy, change and register from YAML.

Run ``grpo fit`` from the folder that holds ``callbacks/`` (``grpo`` puts the working directory on
``sys.path``, as ``python -m`` does) and name a callback by its dotted path::

    trainer:
      callbacks:
        - class_path: callbacks.StopWhenRewardReached
          init_args: {threshold: 0.9, window: 10}

``configs/examples/user_callbacks.yaml`` registers all three on the quickstart task; how to write
one is in ``docs/callbacks.md``. This folder is not part of the installed package.
"""

from callbacks.rollouts_to_parquet import RolloutsToParquet
from callbacks.save_best_policy import SaveBestPolicy
from callbacks.stop_on_reward import StopWhenRewardReached

__all__ = ["RolloutsToParquet", "SaveBestPolicy", "StopWhenRewardReached"]

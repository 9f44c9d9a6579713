"""Rewards computed from decoded responses: rule rewards by `data_source`, or the user's `reward.fn`.

Importing the package registers the built-in rules (gsm8k, boxed math, DAPO math, embedded tasks); names are
imported from their modules (`registry`, `reward_fn`, `build`, `worker`).
"""

from engine.rewards import boxed_math, dapo_math, embedded, gsm8k  # noqa: F401  (register the rules)

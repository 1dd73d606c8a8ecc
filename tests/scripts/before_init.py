"""A collective called before meta_dist is initialised must say so and how to fix it."""
import numpy as np

import meta_dist

try:
    meta_dist.allreduce(np.ones(2))
except RuntimeError as error:
    print(f"refused: {error}")

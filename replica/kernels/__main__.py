"""``python -m replica.kernels``: build the kernels for this machine (`make install` runs it)."""

import sys

from replica.kernels import available, build

print(build())
sys.exit(0 if available() else 1)

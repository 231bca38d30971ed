"""`python -m replica.model.kernels`: build the kernels for this machine (`make install`)."""

import sys

from replica.model.kernels import available, build

print(build())
sys.exit(0 if available() else 1)

"""``python3 -m epx.compat.shim`` prints the directory of the deep_ep / flashinfer shims:

    export PYTHONPATH="$(python3 -m epx.compat.shim)${PYTHONPATH:+:$PYTHONPATH}"
"""

import os

print(os.path.dirname(os.path.abspath(__file__)))

"""`python -m services.decoder`: the decoder's entry point (flags, serving, ranks) is `api/main.py`."""

import sys

from services.decoder.api.main import main

if __name__ == "__main__":
    sys.exit(main())

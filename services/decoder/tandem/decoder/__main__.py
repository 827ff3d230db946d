"""`python -m tandem.decoder`: the decoder's entry point is `api/main.py`."""

import sys

from tandem.decoder.api.main import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m nanoqwen_lib` is the `nanoqwen` command."""
import sys

from nanoqwen_lib.cli import main

sys.exit(main())

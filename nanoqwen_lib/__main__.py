"""`python -m nanoqwen_lib` is the `nanoqwen` command."""
import sys

from .cli import main

sys.exit(main())

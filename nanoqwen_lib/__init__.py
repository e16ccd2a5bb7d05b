"""nanoqwen: the library the book builds. One module per chapter's piece."""
__version__ = "0.1.0"

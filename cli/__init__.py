"""The ``kvstore`` command-line application (click). Parses options, calls the library, prints."""

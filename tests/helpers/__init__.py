"""Helpers shared by the test modules: forging entries (``entries``), running the CLI in-process
and in its own process (``cli``), and the crash/corruption/concurrency trials (``trials``) that
the reliability tests run a few times and the soak runs hundreds of times."""

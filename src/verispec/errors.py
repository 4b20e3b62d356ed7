"""The one exception type a user of verispec can cause, with messages that say what to do."""


class VerispecError(ValueError):
    """Bad input or an unusable model/file: the message says what went wrong and how to fix it."""

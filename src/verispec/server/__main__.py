"""`python -m verispec.server`: the same as `verispec serve`."""

from verispec.server.app import main

main()

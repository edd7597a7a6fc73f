"""C++ torch operators marspec compiles on first use (:mod:`marspec.backends.kernels.build`); their
sources ship in this package."""

"""marspec's version, in a module of its own so that any module can read it without importing the
package's root (whose lazy exports name the whole library)."""

__version__ = "0.1.0"

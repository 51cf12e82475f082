"""qconv's version, in a leaf module: the manifest records it without importing the package root (which offers
`qconv.load`, a layer above)."""

__version__ = "0.1.0"

"""Codecs for streamed bytes: a block's chunks stored encoded in the host store, copied encoded, decoded on the device
before the block's forward. exponent_huffman.py is the first (lossless for 16-bit floats); its format and CPU
reference are here, its GPU decoder and its place behind the tier seam are issue 39's next steps."""

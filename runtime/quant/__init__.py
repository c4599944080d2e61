"""Weight formats for the linear layers: quantized (int8, int4, nf4) and oneDNN-prepacked."""

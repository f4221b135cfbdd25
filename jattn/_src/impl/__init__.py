"""The implementations of dot_product_attention and the choice between them."""

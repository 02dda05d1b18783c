"""What identifies reusable work: the request key per row (`PrefixKey`), the model namespace and the weights probe."""

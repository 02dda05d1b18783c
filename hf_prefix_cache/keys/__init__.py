"""What identifies reusable work besides token ids: the model namespace and the weights probe."""

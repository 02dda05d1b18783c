"""Tables of tiny media model families: how to build each and the inputs of its requests."""

"""The recall tier: every token that leaves the window, kept exact on disk, indexed by 4-bit
keys and recalled by what each step's query needs."""

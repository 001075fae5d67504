"""The recall tier: every token that leaves the window, kept on disk (8-bit keys, 4-bit
values), indexed by 4-bit keys and recalled by what each step's query needs."""

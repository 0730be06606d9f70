"""`lab doctor`: what is wrong with a training configuration, ranked.

`checks` holds the pure checks, each turning numbers into a `Finding`;
`diagnosis` compiles and runs the configuration and gathers their evidence.
"""

"""Speculative decoding without a second model: drafts from prompt lookup and the grammar's forced tokens,
verified as extra query tokens of ordinary rows in the unified token budget (each with its own adapter and
grammar mask); accepted drafts keep their KV, rejected ones give their slots back.

ngram.py           prompt lookup over a row's prompt and output
grammar_drafts.py  forced tokens as drafts, drafts checked by the matcher, per-position bitmasks
history.py         drafts from a scope's recent outputs, within each tenant's own budget
proposer.py        which drafts each row carries into a step, adaptive lookahead, backing off
verify.py          what the sampler sees at each draft position; how many drafts are accepted
"""

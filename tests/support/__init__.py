"""What the tests share, imported as ``tests.support.<module>`` (test modules never import one another).

``builders``: clients, methods, federations and the rounds that run them; ``checks``: comparisons
of parameters and run states; ``references``: transcriptions of reference code that several method
files use; ``runs``: results folders and processes of end-to-end runs; ``configs``: config
spellings; ``paths``: where the repository's files are; ``params``: parameters of the tests over
every method; ``browser``: headless Chromium.
"""

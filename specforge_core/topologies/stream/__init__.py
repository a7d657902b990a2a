"""The disaggregated topology: producers capture into a stream that consumers train from.

:mod:`.record` is what both sides share (the stream record, markers, locks, the control
plane and store of a stream); :mod:`.producer` is ``specforge run --role producer`` and
:mod:`.consumer` the training source of ``specforge run --role consumer``.
"""

"""FP8 base weights (contract 10): the scheme (`config`), e4m3 block math (`fp8`), the layers' weight
container (`storage`) and the checkpoint rules (`checkpoint`). Imports only torch and `moelora.errors`."""

